"""Sparse MLA decode kernel (split-K, heads on the dot's M dimension) against a float64 reference.

Triton mode: without CUDA these run under the Triton interpreter. TRITON_INTERPRET is read by
triton when it is first imported (its own jit helpers such as tl.zeros are made then), so it is
set here before the first triton import; pytest imports every test module before running any
test and nothing in pdserve imports triton at import time, so the whole CPU run is interpreted,
the only mode Triton has without a GPU. With CUDA the same tests run compiled on the GPU, plus
bf16 (the interpreter's bf16 tl.dot is wrong, triton issue 11584).
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from benchmarks.kernels.baseline import sparse_mla_decode_per_head  # noqa: E402
from pdserve_kernels import _launch, configs, kv_fp8  # noqa: E402
from pdserve_kernels.ref import sparse_mla_decode_ref  # noqa: E402
from pdserve_kernels.sparse_mla import num_splits, sparse_mla_decode, sparse_mla_decode_fp8  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, assert_close, poisoned_empty, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def make(B, S, H, D, N, K, dtype, gen, row_pad=0, pad_every=0):
    q = torch.randn(B, S, H, D, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(N, D + row_pad, generator=gen).to(DEVICE, dtype)[:, :D]
    idx = torch.randint(0, N, (B, S, K), generator=gen, dtype=torch.int32)
    if pad_every:
        idx[:, :, ::pad_every] = -1
    return q, kv, idx.to(DEVICE)


def run_both(q, kv, idx, d_v, sink=None, fn=sparse_mla_decode):
    scale = q.shape[-1] ** -0.5
    with poisoned_empty():
        out, lse = fn(q, kv, idx, scale, d_v, sink=sink)
    want, want_lse = sparse_mla_decode_ref(
        q.double(), kv.double(), idx, scale, d_v, sink=None if sink is None else sink.double()
    )
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == want.shape and lse.shape == want_lse.shape
    return out, lse, want, want_lse


def check_lse(lse, want_lse):
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.equal(lse[~fin], want_lse[~fin].float())  # -inf where nothing was attended
    torch.testing.assert_close(lse[fin].double(), want_lse[fin].double(), atol=2e-3, rtol=0)


# (B, S, H, D, d_v, N, K): K not a multiple of the 16-row tile, H below and above a head block,
# non-power-of-two D and d_v (tiny model), the V3.2 split 512 + 64, no rope tail (V4: D = d_v).
SHAPES = [
    (2, 1, 4, 80, 64, 300, 37),
    (1, 3, 20, 48, 32, 100, 70),
    (3, 2, 16, 576, 512, 400, 50),
    (2, 1, 8, 128, 128, 200, 33),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    B, S, H, D, d_v, N, K = shape
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    q, kv, idx = make(B, S, H, D, N, K, dtype, gen, row_pad=8, pad_every=5)
    out, lse, want, want_lse = run_both(q, kv, idx, d_v)
    assert_close(out, want, dtype)
    check_lse(lse, want_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_padding_and_empty_queries(dtype):
    gen = torch.Generator().manual_seed(7)
    q, kv, idx = make(3, 2, 6, 80, 150, 45, dtype, gen, row_pad=24)
    idx[0, 1] = -1  # a query with nothing to attend to
    idx[1, 0, 10:] = -1  # trailing padding
    idx[2, :, ::2] = -1  # interleaved padding
    sink = torch.randn(6, generator=gen).to(DEVICE)
    out, lse, want, want_lse = run_both(q, kv, idx, 64, sink=sink)
    assert_close(out, want, dtype)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    check_lse(lse, want_lse)
    out, lse, want, want_lse = run_both(q, kv, idx, 64)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert torch.isneginf(lse[0, 1]).all()
    check_lse(lse, want_lse)


def test_split_count():
    cfg = configs.MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, waves=8, min_tiles=1)
    assert num_splits(bs=1, head_blocks=1, tiles=128, sms=132, cfg=cfg) == 128
    assert num_splits(bs=1000, head_blocks=2, tiles=128, sms=132, cfg=cfg) == 1
    capped = dataclasses.replace(cfg, max_splits=6)
    assert num_splits(bs=1, head_blocks=1, tiles=128, sms=132, cfg=capped) == 6
    for bs, tiles in ((1, 7), (3, 40), (64, 9)):
        splits = num_splits(bs, 1, tiles, 4, cfg)
        per = -(-tiles // splits)
        assert (splits - 1) * per < tiles <= splits * per  # no empty split


@pytest.mark.parametrize("fused_merge", [True, False])
def test_many_splits_merged_in_kernel_or_second_pass(fused_merge):
    """13 splits of one tile, 2 head blocks, S > 1, an all-padding query and sinks; the fused
    merge's counters are all zero again afterwards (graph replay relies on it), call after call."""
    cfg = configs.MLAConfig(
        block_h=16, block_n=16, num_warps=4, num_stages=1, waves=8, min_tiles=1, fused_merge=fused_merge
    )
    gen = torch.Generator().manual_seed(3)
    q, kv, idx = make(2, 2, 20, 80, 500, 200, torch.float32, gen, pad_every=3)
    idx[1, 0] = -1
    sink = torch.randn(20, generator=gen).to(DEVICE)
    scale = 80**-0.5
    for sk in (sink, None):
        with poisoned_empty():
            out, lse = sparse_mla_decode(q, kv, idx, scale, 64, sink=sk, config=cfg)
        want, want_lse = sparse_mla_decode_ref(
            q.double(), kv.double(), idx, scale, 64, sink=None if sk is None else sk.double()
        )
        assert_close(out, want, torch.float32)
        check_lse(lse, want_lse)
        assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
        if fused_merge:
            assert not _launch._COUNTERS[q.device].any()


@pytest.mark.parametrize("fused_merge", [True, False])
def test_cuda_graph_replay(fused_merge):
    """Replays of a captured call over new index sets give fresh, correct results (the fused
    merge's counters reset themselves); on CPU the same sequence runs eagerly."""
    gen = torch.Generator().manual_seed(8)
    cuda = DEVICE == "cuda"
    q, kv, idx = make(
        1, 1, 64 if cuda else 16, 80, 4000, 2048 if cuda else 160, torch.bfloat16 if cuda else torch.float32, gen
    )
    cfg = configs.MLAConfig(
        block_h=16,
        block_n=64 if cuda else 16,
        num_warps=4,
        num_stages=2 if cuda else 1,
        min_tiles=1,
        max_splits=8,
        fused_merge=fused_merge,
    )
    scale = 80**-0.5
    run = lambda: sparse_mla_decode(q, kv, idx, scale, 64, config=cfg)  # noqa: E731
    out, _ = run()
    graph = None
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = run()
    for _ in range(3):
        idx.copy_(torch.randint(0, 4000, idx.shape, generator=gen, dtype=torch.int32).to(DEVICE))
        if graph is not None:
            graph.replay()
        else:
            out, lse = run()
        want, want_lse = sparse_mla_decode_ref(q.double(), kv.double(), idx, scale, 64)
        assert_close(out, want, q.dtype)
        check_lse(lse, want_lse)


def test_fp8_records_match_their_reference():
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q = torch.randn(2, 2, 16, 576, generator=gen).to(DEVICE, dtype)
    records = kv_fp8.pack_kv_fp8(torch.randn(120, 576, generator=gen), 512).to(DEVICE)
    assert records.shape == (120, 656)
    pool = torch.zeros(120, 672, dtype=torch.uint8, device=DEVICE)  # row stride 672 > 656
    pool[:, :656] = records
    idx = torch.randint(0, 120, (2, 2, 40), generator=gen, dtype=torch.int32).to(DEVICE)
    idx[1, 1] = -1
    idx[0, 0, ::3] = -1
    scale = 576**-0.5
    with poisoned_empty():
        out, lse = sparse_mla_decode_fp8(q, pool[:, :656], idx, scale, 512)
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_ref(q.double(), records, idx, scale, 512)
    assert_close(out, want, dtype)
    check_lse(lse, want_lse)


def test_fp8_pack_roundtrip_is_close():
    kv = torch.randn(64, 576)
    back = kv_fp8.unpack_kv_fp8(kv_fp8.pack_kv_fp8(kv, 512), 512, 576)
    assert ((back - kv).norm() / kv.norm()).item() < 0.04  # e4m3 has a 3-bit mantissa
    torch.testing.assert_close(back[:, 512:], kv[:, 512:].bfloat16().float())


def test_per_head_baseline_matches_reference():
    gen = torch.Generator().manual_seed(5)
    q, kv, idx = make(2, 1, 3, 80, 90, 29, torch.float32, gen, pad_every=4)
    idx[1] = -1
    sink = torch.randn(3, generator=gen).to(DEVICE)
    out, lse, want, want_lse = run_both(q, kv, idx, 64, sink=sink, fn=sparse_mla_decode_per_head)
    assert_close(out, want, torch.float32)
    check_lse(lse, want_lse)


def test_rejects_bad_inputs():
    q = torch.randn(1, 1, 4, 80, device=DEVICE)
    kv = torch.randn(10, 80, device=DEVICE)
    idx = torch.zeros(1, 1, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        sparse_mla_decode(q, kv, idx.long(), 0.1, 64)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_decode(q, kv, idx, 0.1, 96)
    with pytest.raises(ValueError, match="kv must be"):
        sparse_mla_decode(q, kv[:, :64], idx, 0.1, 64)
    with pytest.raises(ValueError, match="sink"):
        sparse_mla_decode(q, kv, idx, 0.1, 64, sink=torch.zeros(3, device=DEVICE))


def test_sm120_configs_fit_shared_memory():
    # every sm_120 entry, at V3.2 (512 + 64) and V4-Flash (512 + 0, padded tail tile of 16) dims
    for fmt in ("bf16", "fp8"):
        for heads, rows in ((16, 1), (64, 1), (64, 64), (128, 64)):
            for has_tail, block_t in ((True, 64), (False, 16)):
                cfg = configs.mla_config(120, fmt, heads, rows, has_tail)
                need = configs.mla_smem_bytes(cfg, 512, block_t, fmt)
                assert need <= configs.SMEM_LIMIT[120], (fmt, heads, rows, cfg, need)
    # the estimate is on the high side: the sm_90 "large" tile estimates 240 KB, compiles to 221 KB
    big = configs.mla_config(90, "bf16", 64, 64)
    assert configs.mla_smem_bytes(big, 512, 64, "bf16") < 1.15 * 221440


# DeepSeek-V4: one K=V head, D = d_v (no rope tail), a sink per head. (T, H, D, N, W, E): T
# queries (T = 1: split + merge path), W window rows and E entry slots per query, as the model's
# indices are built (deepseek_v4/step.py). The V4-Flash head counts (64; 16 per TP4 rank), odd H below and
# above a head block, a non-power-of-two small D.
V4_SHAPES = [
    (1, 64, 512, 300, 8, 24),
    (3, 64, 512, 200, 8, 12),
    (4, 16, 512, 150, 6, 10),
    (3, 7, 48, 90, 5, 9),
    (2, 33, 80, 100, 8, 20),
]


def v4_indices(T, W, E, N, gen):
    """[T, 1, W + E] int32: a window part whose first rows are -1 (positions before 0), an entries
    part with trailing -1 (entries not yet visible) and -1 among the picks; the last query (when
    T > 1) reads nothing at all."""
    idx = torch.randint(0, N, (T, W + E), generator=gen, dtype=torch.int32)
    for t in range(T):
        idx[t, : (t * 3) % W] = -1  # leading window padding
        idx[t, W + E - (t * 5) % E - 1 :] = -1  # trailing entries padding
    idx[torch.rand(T, W + E, generator=gen) < 0.2] = -1  # and anywhere
    if T > 1:
        idx[-1] = -1
    return idx[:, None].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", V4_SHAPES)
def test_v4_shapes_with_sinks_match_reference(shape, dtype):
    T, H, D, N, W, E = shape
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    q = torch.randn(T, 1, H, D, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(N, D + 16, generator=gen).to(DEVICE, dtype)[:, :D]  # row stride > D
    idx = v4_indices(T, W, E, N, gen)
    sink = (2 * torch.randn(H, generator=gen)).to(DEVICE)  # float32, as the model keeps it
    out, lse, want, want_lse = run_both(q, kv, idx, D, sink=sink)
    assert_close(out, want, dtype)
    check_lse(lse, want_lse)
    if T > 1:  # nothing to read: zero output, all the mass on the sink
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        torch.testing.assert_close(lse[-1, 0], sink.float())


def test_reference_sink_is_transformers_sink():
    """The reference's sink (exp(sink) added to the denominator only) is transformers'
    deepseek_v4 eager sink: the logits with the sink appended as one more column, softmax, the
    sink's column dropped. float64 here; transformers keeps the sinks in float32 and promotes."""
    gen = torch.Generator().manual_seed(4)
    T, H, D, N, K = 3, 5, 24, 40, 11
    q = torch.randn(T, 1, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(N, D, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, N, (T, 1, K), generator=gen, dtype=torch.int32)
    idx[1, 0, 3:7] = -1
    sink = torch.randn(H, generator=gen, dtype=torch.float64)
    out, _ = sparse_mla_decode_ref(q, kv, idx, D**-0.5, D, sink=sink)
    for t in range(T):
        keep = idx[t, 0][idx[t, 0] >= 0].long()
        logits = q[t, 0] @ kv[keep].T * D**-0.5  # [H, k]
        combined = torch.cat([logits, sink[:, None]], dim=-1)
        probs = torch.softmax(combined - combined.max(-1, keepdim=True).values, dim=-1)[:, :-1]
        torch.testing.assert_close(out[t, 0], probs @ kv[keep], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_two_sources_equal_one_concatenated_buffer(dtype, splits):
    """DeepSeek-V4 reads its window records and its compressed entries where they lie (two pool
    regions): attention over (kv, indices) + (extra_kv, extra_indices) equals attention over one
    buffer cat([kv, extra_kv]) with the extra indices shifted by N, in float64. K is not a
    multiple of the tile, so a tile straddles the two sources; rows of both sources are strided."""
    T, H, D, N, N2, W, E = 5, 8, 64, 90, 70, 9, 23
    gen = torch.Generator().manual_seed(11 + splits)
    q = torch.randn(T, 1, H, D, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(N, D + 16, generator=gen).to(DEVICE, dtype)[:, :D]
    extra = torch.randn(N2, D + 8, generator=gen).to(DEVICE, dtype)[:, :D]
    idx = v4_indices(T, W, 3, N, gen)[:, :, :W]  # window rows, leading -1
    idx2 = torch.randint(0, N2, (T, 1, E), generator=gen, dtype=torch.int32)
    idx2[torch.rand(T, 1, E, generator=gen) < 0.3] = -1
    idx2[-1] = -1  # the last query reads nothing of the second source
    idx2 = idx2.to(DEVICE)
    sink = torch.randn(H, generator=gen).to(DEVICE)
    cfg = configs.MLAConfig(
        block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1, max_splits=splits, fused_merge=True
    )
    scale = D**-0.5
    with poisoned_empty():
        out, lse = sparse_mla_decode(q, kv, idx, scale, D, sink=sink, config=cfg, extra_kv=extra, extra_indices=idx2)
    flat = torch.cat([kv, extra]).double()
    joined = torch.cat([idx, torch.where(idx2 >= 0, idx2 + N, -1)], dim=2)
    want, want_lse = sparse_mla_decode_ref(q.double(), flat, joined, scale, D, sink=sink.double())
    assert_close(out, want, dtype)
    check_lse(lse, want_lse)
    got, got_lse = sparse_mla_decode_ref(
        q.double(), kv.double(), idx, scale, D, sink=sink.double(), extra_kv=extra.double(), extra_indices=idx2
    )
    torch.testing.assert_close(got, want)  # the reference's own two-source path
    torch.testing.assert_close(got_lse, want_lse)
