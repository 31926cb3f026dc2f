"""DeepSeek-V4's verify steps replayed as CUDA graphs of chunks (engine/cuda_graphs.py,
`verify_as_chunks`), their logic on CPU: a replay runs the model's forward over the static,
padded batch, so that forward (run eagerly here in place of the replay) must give the real rows
exactly the eager verify step's hidden states and leave every real sequence's records (token
blocks, window blocks, state slots: the record read and the spare one written) as the eager step
does, while the padding sequences write only the scratch block, window block and state slot, for
equal chunks and for a mix of a verify chunk, a plain decode and a recompute. Which steps fit which
graph. Through the engine: speculative greedy (drafts from a proposer with every accepted length,
and MTP) == plain greedy, token for token, with verify steps replayed, mixed ones among them. Capture and replay themselves need a
GPU (scripts/gpu_graphs_check.py --verify-k).
"""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.cuda_graphs import CudaGraphRunner, chunk_shapes, graph_ladder
from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import KVCache
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)

BS = 4
SPACES = (20, 20, 6)  # token blocks, window blocks, state slots (+ one scratch each)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_v4_graphs"), "deepseek_v4", seed=0))


@pytest.fixture(scope="module")
def model(path):
    from pdserve.model.deepseek_v4.loader import load_v4_model

    return load_v4_model(path, dtype=torch.float32)


def pool(model) -> KVCache:
    blocks, wblocks, slots = SPACES
    return KVCache(
        model.kv_cache_specs(), model.num_layers, blocks + 1, BS, torch.float32, "cpu", wblocks + 1, slots + 1
    )


def runner(model, kv: KVCache, max_chunk: int, max_bs: int = 8) -> CudaGraphRunner:
    """A chunk-graph runner whose replay runs the static batch eagerly (CPU)."""
    blocks, wblocks, slots = SPACES
    r = CudaGraphRunner(model, kv, max_bs=max_bs, max_len=40, scratch_block=blocks, scratch_window_block=wblocks,
                        scratch_state_slot=slots, max_chunk=max_chunk, as_chunks=True)  # fmt: skip
    r.buckets = [8, 16, 40]
    r.replay = lambda key: r.keep(key, model.forward(r.static_batch(*key), kv))
    return r


def step(ids, starts, tables, wtables, slots, dst=None) -> StepInputs:
    W = max(len(t) for t in tables)
    return StepInputs(
        input_ids=torch.tensor(sum(ids, [])), lens=torch.tensor([len(i) for i in ids]), starts=torch.tensor(starts),
        samples=torch.ones(len(ids), dtype=torch.bool),
        block_tables=torch.tensor([t + [0] * (W - len(t)) for t in tables]),
        window_tables=torch.tensor([t + [-1] * (W - len(t)) for t in wtables]), state_slots=torch.tensor(slots),
        state_dst=None if dst is None else torch.tensor(dst),
    )  # fmt: skip


TABLES = [[7, 2, 11, 4, 13], [0, 16], [5, 9, 18]]
WTABLES = [[3, 10, 1, 6, 14], [8, 17], [2, 0, 12]]


def prefilled(model) -> KVCache:
    """Three sequences of 15, 3 and 7 prompt tokens in the pool (state slots 2, 0, 1)."""
    kv, g = pool(model), torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (15, 3, 7)]
    model.forward(ForwardBatch.build(step(prompts, [0, 0, 0], TABLES, WTABLES, [2, 0, 1]), BS), kv)
    return kv


@pytest.mark.parametrize(
    "ids,dst,padding",
    [
        ([[21, 30, 31], [22, 40, 41], [23, 50, 51]], [3, 4, 5], 3),  # verify chunks of 2 drafts
        ([[21, 30, 31], [22], [23, 50]], [3, 0, 1], 6),  # 2 drafts; a plain decode; a recompute
    ],
)
def test_padded_chunk_batch_gives_the_eager_verify_step(model, ids, dst, padding):
    """Chunks at 15, 3 and 7 that cross CSA groups (rate 4) and the HCA rate (16); a verify
    chunk writes its new state to a spare slot (3, 4, 5), the others in place. Replayed on the
    graph of 4 chunks of up to 3 tokens: its 12 rows less the step's go to a padding sequence
    (tokens 0 at positions 0.. of the scratch block, window block and state slot)."""
    kv = prefilled(model)
    verify = step(ids, [15, 3, 7], TABLES, WTABLES, [2, 0, 1], dst=dst)
    eager_kv = copy.deepcopy(kv)
    want = model.forward(ForwardBatch.build(verify, BS), eager_kv)  # [T, hidden], the chunk path

    r = runner(model, kv, max_chunk=4)
    assert r.shape_of(verify) == (4, 3)
    got = r.run(verify)
    assert list(r.outputs) == [(4, 3, 40)]  # the longest context, 19, takes the last bucket
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the static batch is the one ForwardBatch.build makes of the step and the padding
    blocks, wblocks, slot = SPACES
    padded = step(ids + [[0] * padding], [15, 3, 7, 0], TABLES + [[blocks] * 5], WTABLES + [[wblocks] * 5],
                  [2, 0, 1, slot], dst=dst + [slot])  # fmt: skip
    built, static = ForwardBatch.build(padded, BS, as_decode_rows=True), r.static_batch(4, 3, 40)
    for f in fields(built):
        want_f, got_f = getattr(built, f.name), getattr(static, f.name)
        if f.name in ("block_tables", "window_tables"):
            got_f = got_f[:, : want_f.shape[1]]  # the static tables are max_len wide
        if f.name not in ("logits_indices", "max_context"):  # (a graph takes logits at every row; the bucket)
            assert torch.equal(got_f, want_f) if isinstance(want_f, torch.Tensor) else got_f == want_f, f.name
    for name, region in kv.regions.items():
        s = region.shape[1] - 1  # the scratch is the last block / slot of its space
        torch.testing.assert_close(region[:, :s], eager_kv.regions[name][:, :s], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")  # fmt: skip
        assert region[:, s].float().abs().sum() > 0, name  # the padding chunk wrote there
        assert eager_kv.regions[name][:, s].float().abs().sum() == 0, name  # the eager step never does


def test_which_steps_replay_a_chunk_graph(model):
    """A step whose chunks sample and are at most k + 1 tokens, any lengths, replays the chunk
    graph of fewest rows with room for them (P >= B sequences of up to n >= the longest tokens,
    P > B unless they fill it); a longer chunk, one that does not sample, or padding longer than
    max_len runs eagerly."""
    assert chunk_shapes(64, 3) == sorted(
        {(p, 3) for p in (1, 2, 4, 8, 16, 32, 48, 64)} | {(p, 2) for p in (1, 2, 4, 8, 16)}
    )
    assert chunk_shapes(64, 4, max_rows=100)[-1] == (16, 4) and (32, 3) not in chunk_shapes(64, 4, max_rows=100)
    r = runner(model, pool(model), max_chunk=3, max_bs=32)  # max_len 40

    def chunks(*lens, dst=True, samples=True):
        B = len(lens)
        st = step([[1] * n for n in lens], [5] * B, [[0, 1, 2]] * B, [[0, 1, 2]] * B, [0] * B, [1] * B if dst else None)
        st.samples[:] = samples
        return r.shape_of(st)

    assert chunks(3, 3, 3) == (4, 3) and chunks(2, 2, 2) == (4, 2) and chunks(2) == (1, 2)
    assert chunks(3, 2) == (4, 3) and chunks(2, 1, 2) == (4, 2)  # mixed lengths (a chunk of 1: no drafts)
    assert chunks(*[3] * 20) == (32, 3) and chunks(*[2] * 20) == (32, 3)  # 2 tokens a chunk: up to 16 sequences
    assert chunks(4) is None and chunks(3, samples=False) is None
    assert chunks(1, 1, dst=False) == (2, 1) and chunks(2, 2, dst=False) == (2, 2)  # plain decode: decode graphs
    # 31 sequences leave 96 - 33 rows to one padding sequence: past max_len; 30 leave 64 to two
    assert chunks(*[1] * 30, 3) is None and chunks(*[1] * 29, 3) == (32, 3)
    assert chunks(*[1] * 31, 3) is None  # 32 sequences and no larger graph


class MixedDrafts:
    """Test proposer: the target's own greedy tokens but for the draft at j = (drafts so far for
    this prompt) % (k + 1) (j = k: all right), so every accepted length comes up."""

    def __init__(self, prompts, expected, k: int) -> None:
        self.expected, self.k, self.calls = {tuple(p): e for p, e in zip(prompts, expected)}, k, {}

    def propose(self, seq, limit: int) -> list[int]:
        key, n = tuple(seq.prompt_token_ids), seq.num_output_tokens
        self.calls[key] = self.calls.get(key, -1) + 1
        bad = self.calls[key] % (self.k + 1)
        return [t + (i == bad) for i, t in enumerate(self.expected[key][n : n + limit])]


PROMPTS = [[5, 9, 14], [7, 21, 33, 42, 5] * 3, list(range(10, 40))]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (13, 6, 9)]


def _llm(path: str, spec: dict | None = None) -> LLM:
    return LLM(path, dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True,
               **({"speculative_config": spec} if spec else {}))  # fmt: skip


def cpu_graphs(llm: LLM) -> list[tuple[int, int]]:
    """The engine's runner given the CudaGraphRunner its config asks for, over a pool with the
    scratch block, window block and state slot, its replay the static batch run eagerly; returns
    (P, n, mixed lengths) of each replay."""
    r, config = llm.engine.runner, llm.engine.config
    max_bs, max_chunk, as_chunks, largest = graph_ladder(config, r.model)
    assert as_chunks and max_chunk == 1 + config.speculative_config.num_speculative_tokens
    # the memory plan profiles the decode graph of most rows and the chunk graph of most rows
    chunks = chunk_shapes(max_bs, max_chunk, config.max_num_batched_tokens)
    assert largest == [(max_bs, 1), max(chunks, key=lambda s: (s[0] * s[1], s[1]))]
    spaces = (r.num_kv_blocks, r.num_window_blocks, r.num_state_slots)
    r.kv_cache = KVCache(r.model.kv_cache_specs(), r.model.num_layers, spaces[0] + 1, r.block_size, r.dtype,
                         r.device, spaces[1] + 1, spaces[2] + 1)  # fmt: skip
    g = CudaGraphRunner(r.model, r.kv_cache, max_bs=max_bs, max_len=r.max_model_len, scratch_block=spaces[0],
                        scratch_window_block=spaces[1], scratch_state_slot=spaces[2], max_chunk=max_chunk,
                        max_rows=config.max_num_batched_tokens, as_chunks=True)  # fmt: skip
    replays, fill = [], g.fill

    def filled(step):  # (P, n, whether the step's chunks differ in length)
        key = fill(step)
        replays.append((*key[:2], len(set(step.lens.tolist())) > 1))
        return key

    def replay(key):
        g.keep(key, r.model.forward(g.static_batch(*key), r.kv_cache))

    g.fill, g.replay, r.graphs = filled, replay, g
    return replays


def _held(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.get_stats()
    return s.kv_blocks_used, s.kv_window_blocks_used, s.kv_state_slots_used


@pytest.fixture(scope="module")
def plain(path) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _llm(path).generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)]


def test_replayed_verify_chunks_give_plain_decodings_tokens(path, plain):
    """Drafts with every accepted length (the new state kept after some rejections, recomputed
    after others) through the graphs: the tokens of plain decoding."""
    k = 2
    llm = _llm(path, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 2})
    llm.engine.spec.proposer = MixedDrafts(PROMPTS, plain, k)
    replays = cpu_graphs(llm)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert {n for _, n, _ in replays} >= {1, 2, 3}  # graphs of decode rows and of chunks of 2 and 3
    assert any(mixed for *_, mixed in replays)  # steps of verify chunks beside decodes and recomputes
    spare = llm.engine.spec.spare
    assert spare.num_kept > 0 and spare.num_recomputes > 0 and _held(llm) == (0, 0, 0)


def test_v4_with_mtp_replays_its_decode_and_verify_steps(path, plain):
    """The MTP layer's input, the target's residual streams, comes out of the replayed graph."""
    llm = _llm(path, {"method": "mtp", "num_speculative_tokens": 2})
    replays = cpu_graphs(llm)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert {n for _, n, _ in replays} >= {1, 3} and llm.engine.spec.stats.num_drafts > 0 and _held(llm) == (0, 0, 0)
