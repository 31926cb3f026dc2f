"""Decode equals prefill at every position, on drawn DeepSeek-V4 and V3.2 configurations.

A `Case` is drawn from a seed (`draw_v4`, `draw_v32`): a transformers model with random weights
(widths, indexer heads and dims, `index_topk` below or above the number of entries, window,
layer-type order, CSA / HCA rates as released or small, hyper-connection width) and a prompt whose
length puts decode across CSA and HCA group ends. `check` runs it:

  - decode: the engine prefills the prompt (in chunks when `chunk`; after a first request left
    its first `cached` tokens in the prefix cache) and decodes `new_tokens` greedily, logprobs on;
  - PD (`pd`): the prompt prefilled on one engine, its KV handed to another through the fake
    connector (the prompt's length is drawn off the rates: the hand-off falls inside a group) and
    decoded there onto other block ids;
  - fresh prefills: every prefix prompt + out[:j] prefilled at once by an engine without a prefix
    cache, so each position's logprobs come from the prefill path;
  - the oracle: transformers' forward over the whole sequence (float32), with ties at a top-k's
    k-th value taken in position order (`first_topk`), the rule of pdserve's kernels.

Every decoded token must be each reference's greedy token and its top logprobs within `TOL` of
theirs; the failing case is printed whole (`Case.__str__`), and its seed reruns it.
`PDSERVE_PROPERTY_DEVICE=cuda` runs the engines on a GPU (Triton kernels, decode in CUDA graphs).

Why the oracle's top-k is pinned: ReLU'd index scores tie exactly (at 0) whenever fewer than k of
a query's entries score above 0, and torch.topk's pick among equal values depends on the row's
length; transformers' logits at position p then change with the number of tokens after p (seen
on the issue's configuration: 1.6 in a logit at L = 300 against L = 330), so no implementation
can equal it there. The stable sort keeps the same values and fixes the order.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.outputs import CompletionOutput, to_entries
from pdserve.sampling_params import SamplingParams
from tests.helpers.oracle import first_topk
from tests.helpers.v4 import hf_v4_model, run

VOCAB = 300
TOP = 5  # logprobs compared a step: the sampled token's and the top 5
# float32 on both sides: decode's GEMVs and prefill's GEMMs sum in other orders, a few float32 ulps
# a layer; 5e-6 was the largest difference seen on the configuration, the drift 1e-3..3e-1
TOL = 5e-5
# FP8 records: the same float32 differences put an e4m3 rounding across its boundary now and then (a
# step of 1/16-1/8 of the value; the rope tail's bf16 likewise), a jump float32 never makes. Rounding
# the records' inputs to bf16 first removed 4 of the 5 such failures of 200 seeds; the largest of
# the long run's fp8 cases was 2.7e-3 (docs/models.md)
TOL_FP8 = 1e-2
# where the engines run: the Triton kernels on a GPU (CUDA graphs for decode), torch on the CPU
DEVICE = os.environ.get("PDSERVE_PROPERTY_DEVICE", "cpu")
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# what each seed exercises besides its drawn widths (seed % len): every path in the first seven
VARIANTS = (
    dict(),
    dict(chunk=True),
    dict(cached=True),
    dict(pd=True),
    dict(fp8=True),
    dict(pd=True, chunk=True, cached=True),
    dict(pd=True, fp8=True),
)


@dataclass(frozen=True)
class Case:
    arch: str  # deepseek_v4 / deepseek_v32
    seed: int
    hf: dict  # the transformers config's fields
    prompt_len: int
    new_tokens: int
    block_size: int
    chunk: int | None = None  # max_num_batched_tokens of the decode engine(s): chunked prefill
    cached: int = 0  # tokens of the prompt a first request leaves in the prefix cache
    pd: bool = False
    kv_cache_dtype: str = "auto"  # fp8: no transformers oracle (it keeps float records)
    notes: dict = field(default_factory=dict)  # what the draw aimed at (entries, top-k side)

    def __str__(self) -> str:
        return "case " + json.dumps(asdict(self), sort_keys=True)


def _topk_for(r: random.Random, entries: int, above: bool) -> int:
    """index_topk below the number of entries at the end of decode, or at / above it (dense)."""
    if above:
        return r.choice([entries + r.randint(0, 8), 512])
    return max(1, r.choice([entries // 8, entries // 3, entries - 2]))


def draw_v4(seed: int) -> Case:
    r, v = random.Random(seed), VARIANTS[seed % len(VARIANTS)]
    fp8 = v.get("fp8", False)
    heads = r.choice([2, 4, 8])
    head_dim = 64 if fp8 else r.choice([32, 48, 64])  # fp8_ds_v4: head_dim - rope a multiple of 16
    rope_factor = 0.25 if fp8 else r.choice([0.125, 0.25])
    rope = int(head_dim * rope_factor)
    released = r.random() < 0.5
    csa, hca = (4, 128) if released else (r.choice([2, 4, 8]), r.choice([8, 16, 32]))
    kinds = [CSA, HCA] + [r.choice([SLIDING, CSA, HCA]) for _ in range(r.randint(1, 3))]
    r.shuffle(kinds)
    n_hash = r.randint(0, 2)  # hash-routed MoE layers first
    new = r.randint(6, 14)
    groups = r.randint(1, 3) if hca == 128 else r.randint(2, min(12, 400 // hca))
    # a V4 block is reused only when every rate divides it (prefix_checkpoints.blocks_reusable)
    block_size = r.choice([4, 8, 16, 32, 64])
    if v.get("cached"):
        block_size = hca * (2 if hca < 64 and r.random() < 0.5 else 1)
        groups = max(groups, (block_size + new) // hca + 1)  # the prompt holds a whole block and more
    prompt_len = groups * hca - r.randint(1, new - 1)  # decode crosses the HCA group's end
    entries = (prompt_len + new) // csa
    topk = _topk_for(r, entries, above=seed % 2 == 1)
    hf = dict(
        vocab_size=VOCAB,
        hidden_size=r.choice([64, 128]),
        num_attention_heads=heads,
        head_dim=head_dim,
        partial_rotary_factor=rope_factor,
        q_lora_rank=r.choice([32, 48]),
        o_groups=r.choice([g for g in (1, 2, 4) if heads % g == 0]),
        o_lora_rank=r.choice([16, 32]),
        index_n_heads=r.choice([1, 2, 4, 16]),
        index_head_dim=r.choice([d for d in (16, 32) if d > rope]),
        index_topk=topk,
        sliding_window=r.choice([4, 8, 16, 128]),
        compress_rates={CSA: csa, HCA: hca},
        layer_types=kinds,
        num_hidden_layers=len(kinds),
        mlp_layer_types=["hash_moe" if i < n_hash else "moe" for i in range(len(kinds))],
        hc_mult=r.choice([1, 2, 4]),
        initializer_range=r.choice([0.05, 0.08, 0.1]),
        max_position_embeddings=512,
    )
    notes = dict(entries=entries, released=released)
    return _case("deepseek_v4", seed, r, v, hf, prompt_len, new, block_size, fp8, notes)


def draw_v32(seed: int) -> Case:
    r, v = random.Random(seed), VARIANTS[seed % len(VARIANTS)]
    v = {k: x for k, x in v.items() if k != "fp8"}  # fp8_ds_mla records need kv_lora_rank 512
    rope = r.choice([4, 8])
    new = r.randint(6, 14)
    prompt_len = r.randint(8, 160)
    context = prompt_len + new
    topk = _topk_for(r, context, above=seed % 2 == 1)
    hf = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=r.randint(2, 3),
        num_attention_heads=(heads := r.choice([2, 4])),
        num_key_value_heads=heads,  # MLA: transformers' eager path repeats no kv head
        kv_lora_rank=r.choice([16, 32]),
        q_lora_rank=48,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=r.choice([8, 16]),
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        index_n_heads=r.choice([1, 2, 4, 16]),
        index_head_dim=r.choice([16, 32]),
        index_topk=topk,
        initializer_range=r.choice([0.05, 0.08]),
        max_position_embeddings=256,
    )
    block_size = r.choice([b for b in (4, 8, 16, 32, 64) if b < prompt_len])
    return _case("deepseek_v32", seed, r, v, hf, prompt_len, new, block_size, False, dict(context=context))


def _case(arch, seed, r, v, hf, prompt_len, new, block_size, fp8, notes) -> Case:
    return Case(
        arch=arch,
        seed=seed,
        hf=hf,
        prompt_len=prompt_len,
        new_tokens=new,
        block_size=block_size,
        chunk=r.choice([7, 16, 50]) if v.get("chunk") else None,
        cached=r.randint(block_size, prompt_len - 1) if v.get("cached") else 0,  # a block at least: a hit
        pd=v.get("pd", False),
        kv_cache_dtype="fp8" if fp8 else "auto",
        notes=notes,
    )


def hf_model(case: Case) -> torch.nn.Module:
    if case.arch == "deepseek_v4":
        return hf_v4_model(case.hf, seed=case.seed)
    torch.manual_seed(case.seed)
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**case.hf, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():  # transformers zero-initializes the routing bias: make it matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.2 - 0.1)
    return model


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP)


def make_engine(path: Path, case: Case, connector=None, **kw) -> LLMEngine:
    per_seq = -(-(case.prompt_len + case.new_tokens) // case.block_size) + 1
    cfg = dict(
        model=str(path),
        dtype="float32",
        kv_block_size=case.block_size,
        num_kv_blocks=per_seq * (case.new_tokens + 3),
        skip_tokenizer_init=True,
        kv_cache_dtype=case.kv_cache_dtype,
        device=DEVICE,
    )
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def decode(path: Path, case: Case, prompt: list[int]) -> CompletionOutput:
    """The prompt prefilled (chunked, after a prefix-cache warm-up, as drawn) and decoded."""
    kw = dict(max_num_batched_tokens=case.chunk) if case.chunk else {}
    eng = make_engine(path, case, **kw)
    if case.cached:
        run(eng, [Request(request_id="warm", prompt_token_ids=prompt[: case.cached], params=params(1))])
    out = run(eng, [Request(request_id="0", prompt_token_ids=prompt, params=params(case.new_tokens))])["0"]
    if case.cached >= case.block_size:  # a whole block of the prompt was cached: the prefill starts past it
        assert out.num_cached_tokens, f"no prefix-cache hit\n{case}"
    _no_leak(eng)
    return out.outputs[0]


def pd_decode(path: Path, case: Case, prompt: list[int]) -> CompletionOutput:
    """The prompt prefilled on one engine and decoded on another, its KV moved by the fake
    connector; decode's pool is partly taken first, so the blocks land on other ids."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="m", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    kw = dict(max_num_batched_tokens=case.chunk) if case.chunk else {}
    prefill, dec = make_engine(path, case, conns[0], **kw), make_engine(path, case, conns[1], **kw)
    dec.add_request(Request(request_id="other", prompt_token_ids=prompt[:5], params=params(2)))
    dec.step()
    hold = Request(request_id="0", prompt_token_ids=prompt, params=params(case.new_tokens), hold_kv=True)
    first = run(prefill, [hold])["0"]
    token = first.outputs[0].token_ids[0]
    handoff = Request(
        request_id="0",
        prompt_token_ids=prompt,
        params=params(case.new_tokens),
        kv_handle=first.kv_handle,
        first_token=FirstToken(token_id=token, logprobs=to_entries(first.outputs[0].logprobs[0])),
    )
    out = run(dec, [handoff])["0"]
    prefill.step()  # takes the release notification
    _no_leak(prefill)
    _no_leak(dec)
    return out.outputs[0]


def fresh_prefills(path: Path, case: Case, seq: list[int]) -> list[CompletionOutput]:
    """Position prompt_len + j's logprobs from a prefill of seq[: prompt_len + j], j < new_tokens."""
    prefixes = [seq[: case.prompt_len + j] for j in range(case.new_tokens)]
    eng = make_engine(path, case, enable_prefix_caching=False, max_num_batched_tokens=sum(map(len, prefixes)))
    out = run(eng, [Request(request_id=str(j), prompt_token_ids=p, params=params(1)) for j, p in enumerate(prefixes)])
    return [out[str(j)].outputs[0] for j in range(len(prefixes))]


def _no_leak(eng: LLMEngine) -> None:
    stats = eng.get_stats()
    assert stats.kv_blocks_used == 0 and stats.kv_state_slots_used == 0, "blocks left in use"


def _steps(out: CompletionOutput) -> list[tuple[int, dict[int, float]]]:
    """Each step's (token, {token: logprob}) of a pdserve output."""
    return [(t, {k: lp.logprob for k, lp in out.logprobs[j].items()}) for j, t in enumerate(out.token_ids)]


def compare(case: Case, what: str, got: list[tuple[int, dict]], want: list[tuple[int, dict]]) -> None:
    """Every step of `got`: the same greedy token as `want`'s, and every logprob both give within
    TOL (TOL_FP8 between two runs on FP8 records). Where the reference's best two tokens are within
    that tolerance the pick may differ, and the sequences part there: the comparison ends."""
    tol = TOL_FP8 if case.kv_cache_dtype == "fp8" else TOL
    for j in range(case.new_tokens):
        (t, lp), (t_ref, lp_ref) = got[j], want[j]
        where = f"{what}: step {j} (position {case.prompt_len + j})"
        if t != t_ref and t in lp_ref and lp_ref[t_ref] - lp_ref[t] <= tol:
            return  # a near tie, within the tolerance
        assert t == t_ref, f"{where}: token {t} != {t_ref}\n{case}"
        diffs = [abs(v - lp_ref[k]) for k, v in lp.items() if k in lp_ref]
        assert diffs and max(diffs) <= tol, f"{where}: logprobs off by {max(diffs):.2e} (> {tol})\n{case}"


def oracle(model: torch.nn.Module, case: Case, seq: list[int]) -> list[tuple[int, dict]]:
    """transformers' greedy token and log-probabilities at positions prompt_len - 1 + j."""
    with torch.no_grad(), first_topk():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
    rows = lp[case.prompt_len - 1 : case.prompt_len - 1 + case.new_tokens]
    return [(int(row.argmax()), dict(enumerate(row.tolist()))) for row in rows]


def check(case: Case, tmp: Path) -> None:
    """The property for one case: decode (and PD decode) == fresh prefills == transformers."""
    model = hf_model(case)
    model.save_pretrained(tmp)
    g = torch.Generator().manual_seed(case.seed)
    prompt = torch.randint(2, VOCAB, (case.prompt_len,), generator=g).tolist()
    out = decode(tmp, case, prompt)
    seq = prompt + list(out.token_ids)
    steps = _steps(out)
    prefilled = [_steps(o)[0] for o in fresh_prefills(tmp, case, seq)]
    compare(case, "decode vs fresh prefill", steps, prefilled)
    if case.pd:
        compare(case, "PD decode vs fresh prefill", _steps(pd_decode(tmp, case, prompt)), prefilled)
    if case.kv_cache_dtype == "auto":
        ref = oracle(model, case, seq)
        compare(case, "fresh prefill vs transformers", prefilled, ref)
        compare(case, "decode vs transformers", steps, ref)
