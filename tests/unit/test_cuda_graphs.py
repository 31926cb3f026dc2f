"""The CUDA-graph decode path's logic on CPU: what a replay computes is the model's forward over
the static, padded batch, so that forward (run eagerly here in place of the replay) must give the
real rows exactly the eager step's hidden states, and the padding rows must write nothing but the
scratch block. Capture and replay themselves need a GPU (scripts/gpu_engine_check.py compares the
greedy tokens with and without graphs there)."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.config import resolve_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import CudaGraphRunner, context_buckets, graph_ladder, graph_shapes, graph_sizes
from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import KVCache
from pdserve.model.loader import load_model
from pdserve.tiny_model import make_tiny_model

BS = 4


def test_graph_sizes():
    assert graph_sizes(1) == [1]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert context_buckets(4096) == [4096] and context_buckets(40) == [40]
    assert context_buckets(163840) == [4096, 16384, 65536, 163840]
    # verify chunks of up to 3 tokens (k = 2): 1..16 sequences with 1 or 2 drafts each, every batch with 2
    assert graph_sizes(20, 3) == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 60]
    assert graph_sizes(64, 4, max_rows=100)[-1] == 64 and 256 in graph_sizes(64, 4)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)
    return load_model(path, dtype=torch.float32, device="cpu", progress=False)


def step(ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> StepInputs:
    B, W = len(ids), max(len(t) for t in tables)
    return StepInputs(
        input_ids=torch.tensor(sum(ids, [])), lens=torch.tensor([len(i) for i in ids]), starts=torch.tensor(starts),
        samples=torch.ones(B, dtype=torch.bool), block_tables=torch.tensor([t + [0] * (W - len(t)) for t in tables]),
        window_tables=torch.full((B, W), -1), state_slots=torch.full((B,), -1),
    )  # fmt: skip


def test_padded_static_batch_gives_the_eager_rows(model):
    num_blocks = 12  # + the scratch block, 12
    kv = KVCache(model.kv_cache_specs(), model.num_layers, num_blocks + 1, BS, torch.float32, "cpu")
    prompts, tables = [[5, 9, 13, 2, 7, 1], [3, 8, 8], [11, 4, 6, 10, 12]], [[7, 2], [0], [5, 9]]
    model.forward(ForwardBatch.build(step(prompts, [0, 0, 0], tables), BS), kv)  # prefill all three
    decode = step([[21], [22], [23]], [6, 3, 5], tables)
    eager_kv = copy.deepcopy(kv)
    snapshot = {name: r.clone() for name, r in kv.regions.items()}
    want = model.forward(ForwardBatch.build(decode, BS), eager_kv)  # [3, hidden]

    runner = CudaGraphRunner(model, kv, max_bs=8, max_len=40, scratch_block=num_blocks)
    runner.buckets = [8, 16, 40]  # small context buckets: this step's longest context, 7, takes the first
    runner.replay = lambda key: runner.outputs.__setitem__(key, model.forward(runner.static_batch(*key), kv))
    assert runner.fits(decode)
    got = runner.run(decode)  # 3 rows padded to a graph of 4, contexts up to 8
    assert list(runner.outputs) == [(4, 1, 8)] and runner.outputs[4, 1, 8].shape[0] == 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    written = torch.zeros(num_blocks, BS, dtype=torch.bool)  # the decode tokens' slots: 2*4+2, 0*4+3, 9*4+1
    written.view(-1)[[10, 3, 37]] = True
    for name, region in kv.regions.items():
        region, eager, before = (
            region[:, :num_blocks],
            eager_kv.regions[name][:, :num_blocks],
            snapshot[name][:, :num_blocks],
        )
        torch.testing.assert_close(region, eager, rtol=0, atol=1e-5)  # (a batch of 4 rounds differently from 3)
        assert torch.equal(region[:, ~written], before[:, ~written])  # nothing else changed ...
        assert kv.regions[name][:, num_blocks].abs().sum() > 0  # ... but the scratch block, where the padding wrote


def test_verify_rows_give_the_eager_chunks_rows(model):
    """Speculative decoding's verify step (chunks of the last token and 0..3 drafts) replayed as
    decode rows, each with its own position and context: its rows equal the eager step's, which
    runs the chunks as chunks (ForwardBatch.build without as_decode_rows), and the pool's writes too."""
    num_blocks = 12
    kv = KVCache(model.kv_cache_specs(), model.num_layers, num_blocks + 1, BS, torch.float32, "cpu")
    prompts, tables = [[5, 9, 13, 2, 7, 1], [3, 8, 8], [11, 4, 6, 10, 12]], [[7, 2, 4], [0, 1], [5, 9]]
    model.forward(ForwardBatch.build(step(prompts, [0, 0, 0], tables), BS), kv)
    verify = step([[21, 30, 31, 32], [22], [23, 40]], [6, 3, 5], tables)  # 3, 0 and 1 drafts: 7 rows
    eager_kv = copy.deepcopy(kv)
    chunks = ForwardBatch.build(verify, BS)
    assert chunks.prefill is not None  # the eager step's chunk form
    want = model.forward(chunks, eager_kv)  # [7, hidden]
    rows = ForwardBatch.build(verify, BS, as_decode_rows=True)
    assert rows.prefill is None and rows.decode_rows.tolist() == list(range(7))
    torch.testing.assert_close(model.forward(rows, copy.deepcopy(kv)), want, rtol=0, atol=1e-5)

    runner = CudaGraphRunner(model, kv, max_bs=4, max_len=40, scratch_block=num_blocks, max_chunk=4)
    runner.buckets = [8, 16, 40]  # the longest context, 10, takes the second
    runner.replay = lambda key: runner.outputs.__setitem__(key, model.forward(runner.static_batch(*key), kv))
    assert runner.fits(verify)
    got = runner.run(verify)  # 7 rows padded to a graph of 8
    assert list(runner.outputs) == [(8, 1, 16)]
    assert runner.seq_ids[:8].tolist() == [0, 0, 0, 0, 1, 2, 2, 7]  # the padding row: its own (scratch) table
    assert runner.positions[:7].tolist() == [6, 7, 8, 9, 3, 5, 6]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, region in kv.regions.items():
        torch.testing.assert_close(region[:, :num_blocks], eager_kv.regions[name][:, :num_blocks], rtol=0, atol=1e-5)
    plain = CudaGraphRunner(model, kv, max_bs=4, max_len=40, scratch_block=num_blocks)  # decode only
    assert not plain.fits(verify)
    assert not runner.fits(step([[1, 2, 3, 4, 5]], [3], [[0, 1]]))  # a chunk longer than 1 + k


def test_the_ladder_and_the_memory_plan_cover_verify_graphs(model):
    """What the runner captures and the memory plan counts (its largest graph's rows): with k
    drafts, B (k + 1) rows for B up to cuda_graph_max_bs, capped by the step's token budget; a
    model whose decode path is not per token keeps decode-only graphs."""
    cfg = dict(model=resolve_model("tiny:deepseek_v3"), max_num_seqs=64)
    assert graph_ladder(EngineConfig(**cfg), model)[1:] == (1, False, [(64, 1)])
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert graph_ladder(EngineConfig(**cfg, speculative_config=spec), model)[1:] == (4, False, [(256, 1)])
    assert {(3, 1), (12, 1), (24, 1), (128, 1)} <= set(graph_shapes(64, 4))
    capped = EngineConfig(**cfg, speculative_config=spec, max_num_batched_tokens=100)
    assert graph_ladder(capped, model)[3] == [(64, 1)]
    plain = type("DecodeOnly", (), {})()  # neither verify_as_decode_rows nor verify_as_chunks
    assert graph_ladder(EngineConfig(**cfg, speculative_config=spec), plain)[1:] == (1, False, [(64, 1)])


def test_what_runs_eagerly(model):
    kv = KVCache(model.kv_cache_specs(), model.num_layers, 5, BS, torch.float32, "cpu")
    runner = CudaGraphRunner(model, kv, max_bs=2, max_len=16, scratch_block=4)
    assert runner.fits(step([[1], [2]], [3, 3], [[0], [1]]))
    assert not runner.fits(step([[1], [2], [3]], [3, 3, 3], [[0], [1], [2]]))  # more rows than the largest graph
    assert not runner.fits(step([[1, 2]], [3], [[0, 1]]))  # a prefill chunk
    assert not runner.fits(step([[1]], [16], [[0, 1, 2, 3, 0]]))  # past max_len
    no_sample = step([[1]], [3], [[0]])
    no_sample.samples[:] = False  # a one-token chunk that does not end its prompt
    assert not runner.fits(no_sample)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_v4_padded_static_batch_gives_the_eager_rows(tmp_path, kv_cache_dtype):
    """DeepSeek-V4 (window, entries, indexer keys, compressor state; fp8: window and entries as
    fp8_ds_v4 pages): the padded static batch gives the real rows the eager step's hidden states
    and pool writes (the decode tokens close CSA and HCA groups), and its padding rows write only
    the scratch block, window block and state slot."""
    from pdserve.model.deepseek_v4.loader import load_v4_model

    model = load_v4_model(make_tiny_model(tmp_path, "deepseek_v4", seed=0), dtype=torch.float32)
    blocks, wblocks, slots = 12, 12, 3  # + one scratch each
    kv = KVCache(
        model.kv_cache_specs(kv_cache_dtype),
        model.num_layers,
        blocks + 1,
        BS,
        torch.float32,
        "cpu",
        wblocks + 1,
        slots + 1,
    )
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (15, 3, 7)]
    tables, wtables = [[7, 2, 11, 4], [0], [5, 9]], [[3, 10, 1, 6], [8], [2, 0]]
    st = step(prompts, [0, 0, 0], tables)
    st.window_tables, st.state_slots = torch.tensor([t + [-1] * (4 - len(t)) for t in wtables]), torch.tensor([2, 0, 1])
    model.forward(ForwardBatch.build(st, BS), kv)  # prefill all three
    decode = step([[21], [22], [23]], [15, 3, 7], tables)
    decode.window_tables, decode.state_slots = st.window_tables, st.state_slots
    eager_kv = copy.deepcopy(kv)
    want = model.forward(ForwardBatch.build(decode, BS), eager_kv)  # [3, hidden]

    runner = CudaGraphRunner(
        model, kv, max_bs=8, max_len=40, scratch_block=blocks, scratch_window_block=wblocks, scratch_state_slot=slots
    )
    runner.buckets = [8, 16, 40]  # this step's longest context, 16, takes the second
    runner.replay = lambda key: runner.outputs.__setitem__(key, model.forward(runner.static_batch(*key), kv))
    assert runner.fits(decode)
    got = runner.run(decode)  # 3 rows padded to a graph of 4
    assert list(runner.outputs) == [(4, 1, 16)]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, region in kv.regions.items():
        n = region.shape[1] - 1  # the scratch is the last block / slot of its space
        torch.testing.assert_close(
            region[:, :n], eager_kv.regions[name][:, :n], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )
        if name in ("window", "csa_kv", "csa_index_k", "hca_kv", "csa_state", "hca_state"):
            assert region[:, n].float().abs().sum() > 0, name  # the padding row wrote there
        assert eager_kv.regions[name][:, n].float().abs().sum() == 0, name  # the eager step never does


def test_static_batch_is_views_of_the_runner_buffers(model):
    """A captured graph reads its inputs where they were at capture: every tensor of the static
    batch must live in a buffer the runner keeps (a tensor made per call would be freed after
    capture and its memory reused; DeepSeek-V4's compressors read `lens`)."""
    from dataclasses import fields

    kv = KVCache(model.kv_cache_specs(), model.num_layers, 5, BS, torch.float32, "cpu")
    runner = CudaGraphRunner(model, kv, max_bs=4, max_len=16, scratch_block=4, max_chunk=3, as_chunks=True)
    kept = {t.untyped_storage().data_ptr() for t in vars(runner).values() if isinstance(t, torch.Tensor)}
    for n in (1, 3):  # decode rows, and DeepSeek-V4's verify chunks (starts, state_dst)
        batch = runner.static_batch(2, n, 16)
        for f in fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                assert value.untyped_storage().data_ptr() in kept, f.name
