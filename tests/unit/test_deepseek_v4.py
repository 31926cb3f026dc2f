"""Parity of pdserve's DeepSeek-V4 with transformers 5.24's deepseek_v4 (the oracle), float32 on CPU.

Tiny random models are made by transformers itself (every bias, sink and position bias made
non-zero, hash tables random), saved with save_pretrained and loaded with pdserve's V4 loader.
pdserve runs them incrementally (flat batches of several sequences over a paged pool, as the
engine does: tests/helpers/v4_pool.py); transformers runs each prompt alone, as a whole.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdserve.model.deepseek_v4.loader import load_v4_model
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import VOCAB, hf_v4_model
from tests.helpers.v4_pool import PoolRunner

pytestmark = pytest.mark.timeout(120)

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
CONFIGS = {
    # 2 streams, window 8, CSA 4 / HCA 8, top-3 index, YaRN on the compressed layers, clamping SwiGLU
    "w8_csa4_hca8": dict(
        num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8}, hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_topk=3,
        partial_rotary_factor=8 / 32, rope_parameters=YARN, swiglu_limit=0.4,
    ),
    # 3 streams, window 6, CSA 4 / HCA 16, sigmoid scores, 4 output groups, tied embeddings, plain rope
    "w6_csa4_hca16": dict(
        num_hidden_layers=5, layer_types=[HCA, CSA, SLIDING, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 16}, hc_mult=3,
        sliding_window=6, o_groups=4, o_lora_rank=8, index_topk=5, partial_rotary_factor=16 / 32,
        scoring_func="sigmoid", tie_word_embeddings=True, hc_sinkhorn_iters=7,
    ),
}  # fmt: skip
# just below, at and above multiples of the compress rates (4, 8, 16) and the windows (6, 8)
PROMPT_LENS = (3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 33)
PROMPT = torch.randint(4, VOCAB, (45,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, pdserve model) with the same weights, through a saved checkpoint."""
    ref = hf_v4_model(CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_v4_model(path, dtype=torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _run(model, pieces: list[list[int]], block_size: int = 8) -> torch.Tensor:
    """Feed `pieces` of one new sequence one forward each; logits of every token [sum, V]."""
    pool = PoolRunner(model, block_size=block_size)
    seq = pool.new_sequence()
    return torch.cat([pool.compute_logits(pool(torch.tensor(p), [len(p)], [seq])) for p in pieces])


def test_prefill_logits_match_transformers(pair):
    ref, model = pair
    with torch.no_grad():
        expected = ref(PROMPT[None]).logits[0]
    for bs in (4, 8, 32):  # an HCA entry per 2 blocks, one a block, several a block
        assert _rel(_run(model, [PROMPT.tolist()], bs), expected) < 1e-4


def test_chunked_prefill_matches_whole_prefill(pair):
    ref, model = pair
    with torch.no_grad():
        expected = ref(PROMPT[None]).logits[0]
    ids = PROMPT.tolist()
    whole = _run(model, [ids])
    for cuts in ((1, 2, 3, 9, 16, 17, 30), (5, 13, 21, 29, 37), tuple(range(1, 45))):
        bounds = (0, *cuts, len(ids))
        chunked = _run(model, [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
        assert _rel(chunked, whole) < 1e-5
        assert _rel(chunked, expected) < 1e-4


def test_indexer_drops_entries(pair):
    """The sparse path is taken: with a top-k covering every entry, the logits change."""
    _, model = pair
    logits = _run(model, [PROMPT.tolist()])
    indexers = [layer.self_attn.compressor.indexer for layer in model.model.layers if layer.self_attn.kind == CSA]
    for ix in indexers:
        ix.topk = 1000
    try:
        dense = _run(model, [PROMPT.tolist()])
    finally:
        for ix in indexers:
            ix.topk = model.config.index_topk
    assert _rel(dense, logits) > 1e-3


def test_batched_greedy_matches_transformers_generate(pair):
    """Prompts of 12 lengths, 4 to 11 new tokens each: the first half prefilled together, the
    second half joining two steps later (in chunks, beside the others' decode tokens); every
    step is one flat forward over all running sequences."""
    ref, model = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    new_tokens = [4 + (i * 5) % 8 for i in range(len(prompts))]
    expected = []
    for p, n in zip(prompts, new_tokens):
        out = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        expected.append(out[0, len(p) :].tolist())

    pool = PoolRunner(model)
    seqs = [pool.new_sequence() for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    todo = {i: list(p) for i, p in enumerate(prompts)}  # prompt tokens not yet fed
    half = len(prompts) // 2
    for step in range(40):
        work = []  # (sequence, tokens fed this step)
        for i in range(len(prompts)):
            if i >= half and step < 2 or len(generated[i]) == new_tokens[i]:
                continue
            if todo[i]:
                take = todo[i] if i < half else todo[i][:7]  # late joiners: chunks of 7
                todo[i] = todo[i][len(take) :]
                work.append((i, take))
            else:
                work.append((i, [generated[i][-1]]))
        if not work:
            break
        ids = torch.tensor([t for _, toks in work for t in toks])
        hidden = pool(ids, [len(toks) for _, toks in work], [seqs[i] for i, _ in work])
        last_rows = torch.cumsum(torch.tensor([len(toks) for _, toks in work]), 0) - 1
        next_ids = pool.compute_logits(hidden[last_rows]).argmax(-1).tolist()
        for (i, _), tok in zip(work, next_ids):
            if not todo[i]:  # the whole prompt is in: this token is sampled
                generated[i].append(tok)
    assert generated == expected


def test_mixed_batch_logits_match_transformers(pair):
    """One step holding decode tokens, prefill chunks that start mid-prompt (past a window, at and
    off group boundaries) and a fresh prompt, then one decode step of all of them: every token's
    logits equal transformers' over the whole sequence (the pool path against the oracle itself,
    not against the per-sequence path it replaced)."""
    ref, model = pair
    g = torch.Generator().manual_seed(3)
    plan = [(8, 1), (16, 1), (20, 13), (0, 12), (31, 9), (3, 1)]  # (tokens cached before, new this step)
    tokens = [torch.randint(4, VOCAB, (c + n + 1,), generator=g) for c, n in plan]
    pool = PoolRunner(model, block_size=4)
    seqs = [pool.new_sequence() for _ in plan]
    for s, (c, _), toks in zip(seqs, plan, tokens):
        if c:  # earlier steps, one sequence each
            pool(toks[:c], [c], [s])
    for new in ([n for _, n in plan], [1] * len(plan)):  # the mixed step, then a decode-only step
        starts = [pool.lengths[s] for s in seqs]
        ids = torch.cat([toks[c : c + n] for c, n, toks in zip(starts, new, tokens)])
        got = pool.compute_logits(pool(ids, new, seqs)).split(new)
        for c, n, toks, logits in zip(starts, new, tokens, got):
            with torch.no_grad():
                want = ref(toks[None, : c + n]).logits[0, c:]
            assert _rel(logits, want) < 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4"), arch="deepseek_v4", seed=0)


def test_tiny_model_loads_in_transformers_and_pdserve(tiny):
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert type(ref).__name__ == "DeepseekV4ForCausalLM"
    c = ref.config
    assert set(c.layer_types) == {SLIDING, CSA, HCA} and set(c.mlp_layer_types) == {"hash_moe", "moe"}
    assert c.hc_mult > 1 and c.sliding_window == 8 and c.compress_rates == {CSA: 4, HCA: 16}
    model = load_v4_model(tiny, dtype=torch.float32)
    ids = torch.arange(4, 60)
    with torch.no_grad():
        expected = ref.eval()(ids[None]).logits[0]
    assert _rel(_run(model, [ids.tolist()]), expected) < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    prompt = tok("The capital of France is", return_tensors="pt")
    out = ref.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert len(set(out[0, prompt.input_ids.shape[1] :].tolist())) > 2


def test_tiny_model_is_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", arch="deepseek_v4", seed=3)
    b = make_tiny_model(tmp_path / "b", arch="deepseek_v4", seed=3)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
