"""The FP8 GEMV (`fp8_gemv.fp8_gemv`, what `fp8_linear` runs at decode M) and the grouped FP8
linear (`fp8_gemm.fp8_grouped_linear`, V4's o_a) against float64 references: every inner-product
mode, odd M / N / K (partial weight blocks, N and K not multiples of the tile), one and many K
splits reduced by the last program to arrive (its counters zero again afterwards), bias, strided
grouped x, groups whose rows are not a multiple of the tile, and the GEMM / dequant paths of the
grouped linear; the gate / up pair with the clamped SwiGLU in the GEMV's epilogue (`fp8_swiglu`). Outputs are NaN-poisoned before each call; inputs are fresh seeded tensors.

Runs under the Triton interpreter without CUDA (TRITON_INTERPRET is set before the first triton
import); on a GPU the same tests run compiled, plus bf16 and a CUDA-graph replay.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import _launch, configs, ref_fp8  # noqa: E402
from pdserve_kernels.fp8_gemm import fp8_grouped_linear, fp8_linear, fp8_swiglu  # noqa: E402
from pdserve_kernels.fp8_gemv import fp8_gemv, gemv_splits  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, REL_TOL, poisoned_empty, rel_err, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()

# fp8 activations: a float32 division on the GPU may round differently from torch's in the last
# bit and move one activation to the next e4m3 value (1/16 relative)
ACT_TOL = {torch.float16: 3e-3 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 2e-2}
GV = configs.Fp8GemvConfig
MODES = {  # name -> config (small tiles: the interpreter's cost, and many tiles and splits)
    "fp8_act": GV(32, 32, 4, 1, waves=8),
    "x_dot": GV(32, 32, 4, 1, fp8_act=False, waves=8),
    "fma": GV(32, 32, 4, 1, fma=True, waves=8),
}
SHAPES = [  # (M, N, K, block): decode M = 1, odd M / N / K, partial blocks, DeepSeek's 128 x 128
    (1, 96, 160, (32, 32)),
    (3, 75, 113, (32, 32)),
    (7, 130, 200, (128, 128)),
    (16, 61, 96, (16, 64)),
]


def weights(N, K, block, gen):
    w = torch.randn(N, K, generator=gen) * K**-0.5
    w[: N // 3, : K // 2] *= 16  # blocks with different scales
    q, s = ref_fp8.quant_block_fp8(w, block)
    return q.to(DEVICE), s.to(DEVICE)


def quantizes(cfg, dtype) -> bool:
    """Whether the kernel quantizes x to e4m3 (the reference must too)."""
    return isinstance(cfg, GV) and cfg.fp8_act and not cfg.fma and dtype != torch.float32


def check(y, want, cfg, dtype):
    assert y.dtype == dtype and not y.isnan().any(), "an output element was not written"
    err = rel_err(y, want)
    tol = ACT_TOL[dtype] if quantizes(cfg, dtype) else REL_TOL[dtype]
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e} ({dtype}, {cfg})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_matches_reference(shape, mode, dtype):
    M, N, K, block = shape
    gen = torch.Generator().manual_seed(seed_of(shape, mode, str(dtype)))
    q, s = weights(N, K, block, gen)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype)
    cfg = MODES[mode]
    with poisoned_empty():
        y = fp8_linear(x, q, s, block, bias=b, config=cfg)
    want = ref_fp8.fp8_linear_ref(x.double(), q, s, block, bias=b, act_quant=quantizes(cfg, dtype))
    check(y, want, cfg, dtype)


@pytest.mark.parametrize("waves", [1, 64])
def test_split_counts_and_counters(waves):
    """waves 1: fewer programs than K steps (one split, or a few); waves 64: a split per K step.
    Every split is reduced exactly once and the arrival counters are zero again afterwards."""
    M, N, K, block, dtype = 5, 70, 300, (32, 32), torch.float32
    gen = torch.Generator().manual_seed(seed_of("splits", waves))
    q, s = weights(N, K, block, gen)
    cfg = dataclasses.replace(MODES["fma"], waves=waves)
    for _ in range(2):  # the second call reuses the counters the first left at zero
        x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
        with poisoned_empty():
            y = fp8_gemv(x, q, s, block, config=cfg)
        check(y, ref_fp8.fp8_linear_ref(x.double(), q, s, block), cfg, dtype)
    assert not _launch.arrival_counters(torch.device(DEVICE), 1, "test").any()
    assert gemv_splits(tiles=3, steps=10, sms=4, waves=64) == 10
    assert gemv_splits(tiles=200, steps=10, sms=4, waves=1) == 1


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32] + [torch.float32])
@pytest.mark.parametrize(
    "path",
    [
        MODES["fp8_act"],
        MODES["fma"],
        configs.Fp8GemmConfig(16, 32, 32, 4, 1, waves=8),  # the GEMM kernel, split K
        configs.Fp8GemmConfig(16, 32, 32, 4, 1, fp8_act=True),
        configs.Fp8GemmConfig(16, 32, 32, 4, 1, dequant=True),  # dequantize, one batched matmul
    ],
    ids=["gemv_fp8_act", "gemv_fma", "gemm", "gemm_fp8_act", "dequant"],
)
def test_grouped_matches_reference(path, dtype):
    """x [M, G, K] a strided view (rows of a wider buffer), R = 48 rows a group (not a multiple
    of the 32-row tile): each group reads only its own slice of x."""
    M, G, K, R, block = (3 if isinstance(path, GV) else 19), 4, 100, 48, (16, 32)
    gen = torch.Generator().manual_seed(seed_of("grouped", str(path), str(dtype)))
    q, s = weights(G * R, K, block, gen)
    x = torch.randn(M, G, K + 28, generator=gen).to(DEVICE, dtype)[:, :, :K]
    with poisoned_empty():
        y = fp8_grouped_linear(x, q, s, block, config=path)
    act = quantizes(path, dtype) or (
        isinstance(path, configs.Fp8GemmConfig) and path.fp8_act and dtype != torch.float32
    )
    want = ref_fp8.grouped_linear_ref(x.double(), q, s, block, act_quant=act)
    assert y.shape == (M, G * R)
    err, tol = rel_err(y, want), ACT_TOL.get(dtype, 0) if act else REL_TOL[dtype]
    assert not y.isnan().any() and err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    # group g alone equals the plain linear of its rows: the groups do not mix
    g, rows = 2, slice(2 * R, 3 * R)
    alone = ref_fp8.fp8_linear_ref(x[:, g].double(), q[rows], s[2 * R // 16 : 3 * R // 16], block, act_quant=act)
    assert rel_err(y[:, rows], alone) < tol


@pytest.mark.parametrize(
    "M,I,K,block,mode",
    [(3, 75, 113, (32, 32), "fp8_act"), (1, 130, 200, (128, 128), "fma"), (16, 61, 96, (16, 64), "x_dot")],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_pair_matches_reference(M, I, K, block, mode, dtype):  # noqa: E741
    """fp8_swiglu at decode M: one launch, gate and up rows streamed by the same programs (split K,
    odd sizes, partial blocks), the clamped SwiGLU in the epilogue; against the two linears and
    the SwiGLU in float64. The limit clamps a good share of both."""
    gen = torch.Generator().manual_seed(seed_of("swiglu_pair", M, I, K, mode, str(dtype)))
    gate, up = weights(I, K, block, gen), weights(I, K, block, gen)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    cfg, limit = MODES[mode], 0.7
    with poisoned_empty():
        y = fp8_swiglu(x, gate, up, limit, block, config=cfg)
    act = quantizes(cfg, dtype)
    g, u = (ref_fp8.fp8_linear_ref(x.double(), *w, block, act_quant=act) for w in (gate, up))
    assert (g > limit).any() and (u.abs() > limit).any()
    check(y, torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit), cfg, dtype)
    assert not _launch.arrival_counters(torch.device(DEVICE), 1, "test").any()


def test_swiglu_pair_above_the_gemv_rows():
    """Past the GEMV's rows fp8_swiglu takes the GEMM on the joined [gate; up] rows (or on each)
    and the SwiGLU kernel on the halves: the same values."""
    M, I, K, block, dtype, limit = 19, 64, 64, (32, 32), torch.float32, 0.7
    gen = torch.Generator().manual_seed(seed_of("swiglu_gemm"))
    gate, up = weights(I, K, block, gen), weights(I, K, block, gen)
    joined = torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]])
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    cfg = configs.Fp8GemmConfig(16, 32, 32, 4, 1)
    g, u = (ref_fp8.fp8_linear_ref(x.double(), *w, block) for w in (gate, up))
    for j in (None, joined):
        with poisoned_empty():
            y = fp8_swiglu(x, gate, up, limit, block, config=cfg, joined=j)
        check(y, torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit), cfg, dtype)
    with pytest.raises(ValueError, match="must match"):
        fp8_swiglu(x, gate, (up[0][:-1], up[1]), limit, block)


def test_grouped_mm_is_the_einsum():
    """The bf16 grouped path (one strided-batched matmul writing y in place) against the einsum."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, 40, generator=gen, dtype=torch.float64)
    w = torch.randn(3 * 7, 40, generator=gen, dtype=torch.float64)
    want = torch.einsum("mgk,grk->mgr", x, w.view(3, 7, 40)).reshape(5, 21)
    assert torch.allclose(ref_fp8.grouped_mm(x, w), want, rtol=1e-12, atol=1e-12)
    assert ref_fp8.grouped_mm(x[:0], w).shape == (0, 21)


def test_dispatch_and_bad_inputs():
    for cc in (90, 120, 0):
        assert configs.fp8_gemv_config(cc, 1) is not None and configs.fp8_gemv_config(cc, 16) is not None
        assert configs.fp8_gemv_config(cc, 17) is None
    assert configs.fp8_gemv_config(90, 1, torch.float32) is configs.FP8_GEMV_FP32
    q, s = weights(8, 32, (32, 32), torch.Generator().manual_seed(0))
    assert fp8_linear(torch.zeros(0, 32, device=DEVICE), q, s, (32, 32)).shape == (0, 8)
    assert fp8_grouped_linear(torch.zeros(0, 2, 32, device=DEVICE), q, s, (32, 32)).shape == (0, 8)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        fp8_grouped_linear(torch.zeros(1, 3, 32, device=DEVICE), q, s, (32, 32))
    with pytest.raises(ValueError, match=r"\[M, G, K\]"):
        fp8_grouped_linear(torch.zeros(1, 32, device=DEVICE), q, s, (32, 32))
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_gemv(torch.zeros(17, 32, device=DEVICE), q, s, (32, 32))


def test_cuda_graph_replay():
    """Replays of a captured split-K call over new x give fresh, correct results (the counters
    reset themselves); on CPU the same sequence runs eagerly."""
    gen = torch.Generator().manual_seed(9)
    cuda = DEVICE == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float16
    N, K, block = (1024, 4096, (128, 128)) if cuda else (64, 256, (32, 32))
    q, s = weights(N, K, block, gen)
    x = torch.randn(2, K, generator=gen).to(DEVICE, dtype)
    cfg = None if cuda else MODES["fp8_act"]
    y = fp8_linear(x, q, s, block, config=cfg)
    graph = None
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fp8_linear(x, q, s, block)
    for _ in range(3):
        x.copy_(torch.randn(2, K, generator=gen).to(DEVICE, dtype))
        if graph is not None:
            graph.replay()
        else:
            y = fp8_linear(x, q, s, block, config=cfg)
        check(y, ref_fp8.fp8_linear_ref(x.double(), q, s, block, act_quant=True), MODES["fp8_act"], dtype)
    assert not _launch.arrival_counters(torch.device(DEVICE), 1, "test").any()
