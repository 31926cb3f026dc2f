"""The MX8 FP4 MoE (FP4 weights x MXFP8 activations, `fused_moe_fp4_mx8`) and its two format
steps: the e2m1 -> e4m3 bit upcast (every code) and the MXFP8 quantizer (against the OCP format
written out here and against `ref_fp4.quant_mxfp8`, torch from the spec), then the whole MoE
against `ref_fp4.fused_moe_fp4_ref(..., mxfp8_act=True)` in float64.

Runs under the Triton interpreter without CUDA, where the kernels replace `tl.dot_scaled` by the
same product in float32 (`EMULATE`); on a GPU the same tests run the real dot_scaled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pdserve_kernels import configs, ref_fp4  # noqa: E402
from pdserve_kernels.fused_moe import moe_align  # noqa: E402
from pdserve_kernels.fused_moe_fp4_mx8 import fused_moe_fp4_mx8  # noqa: E402
from pdserve_kernels.mxfp8 import e2m1_to_e4m3, quant_mxfp8  # noqa: E402
from tests.helpers.kernels import DEVICE, poisoned_empty, rel_err, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)
require_interpreter()

DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # x is quantized in the kernel: no bf16 dot
# against the float64 MXFP8 reference: the kernel's float32 sums and y rounded to x's dtype; an
# activation the float32 sums pushed across an e4m3 rounding boundary would cost ~1e-3. MXFP8 vs
# unquantized activations differ by several percent (`check` asserts it, so the test can tell)
TOL = {torch.float32: 2e-4, torch.float16: 1e-3, torch.bfloat16: 5e-3}
E4M3 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


# --- e2m1 -> e4m3 ---------------------------------------------------------------------------------


@triton.jit
def _upcast_kernel(c_ptr, o_ptr):
    r = tl.arange(0, 16)
    tl.store(o_ptr + r, e2m1_to_e4m3(tl.load(c_ptr + r)))


def test_e2m1_to_e4m3_is_exact_on_every_code():
    codes = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(16, dtype=torch.uint8, device=DEVICE)
    _upcast_kernel[(1,)](codes, out)
    e2m1 = ref_fp4.e2m1_table(torch.float64)
    assert torch.equal(out.cpu().view(E4M3).double(), e2m1)  # the same values ...
    assert torch.equal(out.cpu(), bits(e2m1.to(E4M3)))  # ... as the e4m3 codes torch gives them
    assert out[8].item() == 0x80  # -0 keeps its sign


# --- the MXFP8 quantizer --------------------------------------------------------------------------


def spec_check(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """The format, independent of any implementation: per 32-value group a power-of-two scale,
    the smallest with amax / scale <= 448, and q the nearest e4m3 value to x / scale."""
    R, K = x.shape
    G = -(-K // 32)
    assert q.dtype == E4M3 and q.shape == (R, K) and s.dtype == torch.uint8 and s.shape == (R, G)
    xg = torch.nn.functional.pad(x.double().cpu(), (0, 32 * G - K)).view(R, G, 32)
    amax = xg.abs().amax(-1)
    scale = torch.exp2(s.cpu().double() - 127)
    nz = amax > 0
    assert (amax[nz] / scale[nz] <= 448).all() and (amax[nz] / scale[nz] > 224).all()
    assert (s.cpu()[~nz] == 0).all()  # an all-zero group: the smallest scale
    assert ((bits(q) & 0x7F) != 0x7F).all()  # no NaN code: with this scale nothing passes 448
    v = (xg / scale[..., None]).view(R, 32 * G)[:, :K]
    got = q.cpu().double()
    grid = torch.tensor([float(b) for b in torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3)], dtype=torch.float64)
    dist = (v.abs()[..., None] - grid).abs()  # to every non-negative e4m3 value
    assert torch.equal((got.abs() - v.abs()).abs(), dist.min(-1).values)  # a nearest one
    assert torch.equal(torch.signbit(got) | (got == 0), torch.signbit(v) | (got == 0))


def sample(gen, R, K):
    """Rows spanning 2**-20 .. 2**20, a zero group, exact boundaries and ties."""
    x = torch.randn(R, K, generator=gen) * torch.exp2(torch.randint(-20, 20, (R, 1), generator=gen).float())
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32) * 448 * 2.0**-3  # amax exactly 448 * 2**-3: scale 2**-3
    x[1, 32:64] = x[1, :32] * (1 + 2**-20)  # just above: the next scale
    x[2, :16] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.5 + 2**-5, 2**-8, 3 * 2**-10, -(2**-9)] * 2)
    x[2, 16:32] = 0.0
    x[2, 16] = 448.0  # row 2's group 0 has scale 2**0: ties to even at 1.0625 -> 1, 1.1875 -> 1.25, 17 -> 16
    return x


@pytest.mark.parametrize("exact_cvt", [True, False] if DEVICE == "cuda" else [True])
@pytest.mark.parametrize("K", [64, 200, 4096])
def test_mxfp8_quantizer_follows_the_format(K, exact_cvt):
    gen = torch.Generator().manual_seed(seed_of("mxfp8", K))
    x = sample(gen, 5, K)
    q, s = quant_mxfp8(x.to(DEVICE), exact_cvt=exact_cvt)
    spec_check(x, q, s)
    want_q, want_s = ref_fp4.quant_mxfp8(x)  # the reference the MoE tests use
    assert torch.equal(s.cpu(), want_s) and torch.equal(bits(q), bits(want_q))
    assert s[1, 0].item() == 127 - 3 and s[1, 1].item() == 127 - 2 and q[1, 31].item() == 448.0
    assert q[2, :8].tolist() == [1.0, 1.25, 16.0, 20.0, 0.5, 2**-8, 2**-8, -(2**-9)]  # ties to even, subnormals


def test_mxfp8_quantizer_takes_bf16_and_fp16_rows():
    gen = torch.Generator().manual_seed(4)
    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randn(3, 96, generator=gen) * 5).to(dt)
        q, s = quant_mxfp8(x.to(DEVICE))
        want_q, want_s = ref_fp4.quant_mxfp8(x.float())
        assert torch.equal(s.cpu(), want_s) and torch.equal(bits(q), bits(want_q))


# --- the MoE --------------------------------------------------------------------------------------


def make(T, E, k, hidden, inter, dtype, gen, ids=None):
    """Fresh random FP4 experts (some groups 16x larger, so scales differ) and routing."""
    x = torch.randn(T, hidden, generator=gen).to(DEVICE, dtype)
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=gen) * inter**-0.5
    w13[:, :, : hidden // 3] *= 16
    (q13, s13), (q2, s2) = ref_fp4.quant_fp4(w13), ref_fp4.quant_fp4(w2)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen).to(DEVICE)
    return x, *(t.to(DEVICE) for t in (q13, q2, s13, s2)), weights, ids.to(DEVICE, torch.int32)


def check(x, q13, q2, s13, s2, weights, ids, limit=None, config=None):
    with poisoned_empty():
        y = fused_moe_fp4_mx8(x, q13, q2, s13, s2, weights, ids, swiglu_limit=limit, config=config)
    args = (x.double(), q13, q2, s13, s2, weights.double(), ids)
    want = ref_fp4.fused_moe_fp4_ref(*args, swiglu_limit=limit, mxfp8_act=True)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert not y.isnan().any(), "NaN in the output: an element was not written"
    tol = TOL[x.dtype]
    assert rel_err(y, want) < tol, f"relative error {rel_err(y, want):.2e} ({x.dtype})"
    # quantizing the activations matters at these sizes far beyond the tolerance
    plain = ref_fp4.fused_moe_fp4_ref(*args, swiglu_limit=limit)
    assert rel_err(want, plain) > 4 * tol
    return y, want


# (T, E, k, hidden, I): odd T; hidden not a multiple of the CPU's 64-value K step (96) nor of the
# 32-value scale group (40, 72: a partial last group); I not a multiple of the 32-wide tile (48, 24)
SHAPES = [(1, 8, 2, 64, 32), (7, 6, 3, 96, 48), (3, 4, 2, 40, 24), (5, 3, 2, 72, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape):
    dtype = DTYPES[SHAPES.index(shape) % 3]
    gen = torch.Generator().manual_seed(seed_of("mx8", shape))
    check(*make(*shape, dtype, gen), limit=1.0)


def test_all_experts_empty_but_one():
    """Every pair on expert 5 of 8: one expert's blocks, the rest of the aligned rows -1 blocks."""
    gen = torch.Generator().manual_seed(9)
    T, E = 19, 8
    ids = torch.full((T, 1), 5)
    _, bexp = moe_align(ids.to(DEVICE, torch.int32), E, configs.moe_fp4_mx8_config(0, T / E).block_m)
    assert (bexp == 5).sum() == 2 and (bexp == -1).any()
    check(*make(T, E, 1, 64, 32, torch.float32, gen, ids=ids))


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_k_matches_reference(splits):
    """w13's float32 partials summed, activated and quantized by `_swiglu_mx8_kernel`; uneven last
    splits (hidden 200 = 3 x 64 + 8, I = 96 = 64 + 32)."""
    gen = torch.Generator().manual_seed(30 + splits)
    cfg = configs.MoEConfig(16, 32, 64, 4, 1, split_k=splits)
    check(*make(5, 4, 2, 200, 96, torch.float32, gen), limit=0.5, config=cfg)


def test_swiglu_limit_clamps():
    gen = torch.Generator().manual_seed(13)
    args = make(6, 4, 2, 64, 32, torch.float32, gen)
    y, want = check(*args, limit=0.25)
    free = ref_fp4.fused_moe_fp4_ref(args[0].double(), *args[1:5], args[5].double(), args[6], mxfp8_act=True)
    assert rel_err(free, want) > 0.05


def test_larger_batch_and_wider_tiles():
    """A config with BN 64 / BK 128 (the GPUs' shape) and blocks of 32 rows."""
    gen = torch.Generator().manual_seed(17)
    check(*make(33, 4, 2, 256, 64, torch.float32, gen), config=configs.MoEConfig(32, 64, 128, 4, 1))


def test_checkpoint_dtypes_and_rejects_bad_tiles():
    gen = torch.Generator().manual_seed(2)
    x, q13, q2, s13, s2, tw, ids = make(3, 4, 2, 64, 32, torch.float32, gen)
    y = fused_moe_fp4_mx8(x, q13, q2, s13, s2, tw, ids)
    e8 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    y2 = fused_moe_fp4_mx8(x, q13.view(torch.int8), q2.view(torch.int8), s13.view(e8), s2.view(e8), tw, ids)
    assert torch.equal(y, y2)
    with pytest.raises(ValueError, match="multiple of the 32"):
        fused_moe_fp4_mx8(x, q13, q2, s13, s2, tw, ids, config=configs.MoEConfig(16, 48, 64, 4, 1))
    with pytest.raises(ValueError, match="w13_scale must be ue8m0"):
        fused_moe_fp4_mx8(x, q13, q2, s13[:, :, :1], s2, tw, ids)
    assert fused_moe_fp4_mx8(x[:0], q13, q2, s13, s2, tw[:0], ids[:0]).shape == (0, 64)
