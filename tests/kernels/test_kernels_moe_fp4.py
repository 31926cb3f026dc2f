"""FP4 (e2m1 + ue8m0 per 32 values) fused MoE against its float64 reference, and the format
helpers (packing, scales, quantizer) it is defined by, on the checkpoint's layout (the fragment
layout the engine re-lays it into: test_kernels_moe_fp4_frag.py).

Runs under the Triton interpreter without CUDA (TRITON_INTERPRET is set before the first triton
import: see test_kernels_sparse_mla.py); on a GPU the same tests run compiled, plus bf16 and the
`tl.dot_scaled` variant.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pdserve_kernels import configs, ref_fp4  # noqa: E402
from pdserve_kernels.fused_moe_fp4 import fused_moe_fp4  # noqa: E402
from pdserve_kernels.fused_moe_fp4_kernels import _e2m1_bits, _ue8m0_x2p14  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, REL_TOL, poisoned_empty, rel_err, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()

ALL_CODES = torch.arange(16, dtype=torch.uint8)


def make(T, E, k, hidden, inter, dtype, gen, ids=None):
    """Fresh random FP4 experts (quantized from Gaussian weights, some groups 16x larger so the
    scales differ) and routing."""
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
        y = fused_moe_fp4(x, q13, q2, s13, s2, weights, ids, swiglu_limit=limit, config=config)
    want = ref_fp4.fused_moe_fp4_ref(
        x.double(), q13, q2, s13, s2, weights.double(), ids, swiglu_limit=limit, act_dtype=x.dtype
    )
    assert y.dtype == x.dtype and y.shape == x.shape
    assert not y.isnan().any(), "NaN in the output: an element was not written"
    err = rel_err(y, want)
    assert err < REL_TOL[x.dtype], f"relative error {err:.2e} ({x.dtype})"
    return y, want


# --- the format ---------------------------------------------------------------------------------


def test_packing_round_trip_is_exact_on_every_code_pair():
    lo, hi = torch.meshgrid(ALL_CODES, ALL_CODES, indexing="ij")
    codes = torch.stack([lo.flatten(), hi.flatten()], -1).reshape(4, 128)  # all 256 byte values
    packed = ref_fp4.pack_fp4(codes)
    assert packed.shape == (4, 64) and packed.dtype == torch.uint8
    assert torch.equal(packed.flatten().sort().values, torch.arange(256, dtype=torch.uint8))
    assert torch.equal(ref_fp4.unpack_fp4(packed), codes)
    assert torch.equal(ref_fp4.unpack_fp4(packed.view(torch.int8)), codes)  # checkpoints' int8
    assert torch.equal(packed[0, 0], torch.tensor(0, dtype=torch.uint8))
    assert ref_fp4.pack_fp4(torch.tensor([3, 10], dtype=torch.uint8)).item() == 0xA3  # low nibble first


def test_e2m1_values_and_encoding():
    vals = ref_fp4.e2m1_table(torch.float64)
    # sign | 2 exponent bits (bias 1) | 1 mantissa bit; exponent 0 is subnormal (0, 0.5)
    c = ALL_CODES.long()
    e, m, sign = (c >> 1) & 3, c & 1, 1 - 2 * (c >> 3)
    want = torch.where(e == 0, m * 0.5, (1 + m * 0.5) * 2.0 ** (e - 1)).double() * sign
    assert torch.equal(vals, want)
    assert torch.equal(ref_fp4.e2m1_encode(vals), ALL_CODES)  # -0 keeps code 8
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0])
    # ties to the even mantissa: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2, ...
    assert ref_fp4.e2m1_encode(mids).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 14]


def test_quantizer_scales_are_powers_of_two_that_fit():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3, 5, 72, generator=gen) * torch.logspace(-4, 2, 72)  # a partial last group
    w[0, 0, :32] = 0.0  # an all-zero group
    packed, scale = ref_fp4.quant_fp4(w)
    assert packed.shape == (3, 5, 36) and scale.shape == (3, 5, 3) and scale.dtype == torch.uint8
    s = ref_fp4.scale_to_float(scale, torch.float64)
    groups = torch.nn.functional.pad(w.double(), (0, 24)).view(3, 5, 3, 32)
    amax = groups.abs().amax(-1)
    nz = amax > 0
    assert (amax[nz] / s[nz] <= 6).all() and (amax[nz] / s[nz] > 3).all()  # the smallest that fits
    back = ref_fp4.dequant_fp4(packed, scale, torch.float64)
    assert torch.equal(back[0, 0, :32], torch.zeros(32, dtype=torch.float64))
    err = (back - w.double()).abs() / s.repeat_interleave(32, -1)[..., :72]
    assert err.max().item() <= 1.0 + 1e-12  # half the widest e2m1 step (4 -> 6), in scale units


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, o_ptr, n_s, BLOCK_S: tl.constexpr):
    """out[i, j] = e2m1(code j) * 2**(s[i] - 127), the kernel's own conversion (float32)."""
    codes = tl.load(c_ptr + tl.arange(0, 16))
    offs_s = tl.arange(0, BLOCK_S)
    s = tl.load(s_ptr + offs_s, mask=offs_s < n_s, other=127)
    v = _e2m1_bits(codes, tl.float32)[None, :] * _ue8m0_x2p14(s)[:, None]
    tl.store(o_ptr + offs_s[:, None] * 16 + tl.arange(0, 16)[None, :], v, mask=(offs_s < n_s)[:, None])


def test_in_kernel_dequant_is_exact_on_every_code_and_scale():
    scales = torch.tensor([2, 3, 90, 113, 120, 126, 127, 128, 140, 200, 240], dtype=torch.uint8)
    out = torch.empty(scales.numel(), 16, device=DEVICE)
    _dequant_kernel[(1,)](ALL_CODES.to(DEVICE), scales.to(DEVICE), out, scales.numel(), BLOCK_S=16)
    want = ref_fp4.e2m1_table(torch.float64)[None, :] * ref_fp4.scale_to_float(scales, torch.float64)[:, None]
    assert torch.equal(out.cpu().double(), want)
    assert torch.equal(torch.signbit(out[:, 8]).cpu(), torch.ones(scales.numel(), dtype=torch.bool))


# --- the kernel ---------------------------------------------------------------------------------

# (T, E, k, hidden, I): T = 1; hidden not a multiple of the 64-value CPU step (96) nor of the
# 32-value scale group (40, 72: partial last group); I not a multiple of the tile (48, 24);
# more experts than pairs.
SHAPES = [
    (1, 8, 2, 64, 32),
    (7, 6, 3, 96, 48),
    (3, 4, 2, 40, 24),
    (5, 3, 2, 72, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    check(*make(*shape, dtype, gen))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_limit_clamps_gate_and_up(dtype):
    """DeepSeek-V4 (swiglu_limit = 10 in its config): gate <= limit, |up| <= limit. A limit inside
    the pre-activations' range changes the output, and the kernel follows the reference."""
    gen = torch.Generator().manual_seed(11)
    args = make(6, 4, 2, 64, 32, dtype, gen)
    y, want = check(*args, limit=0.25)
    free = ref_fp4.fused_moe_fp4_ref(args[0].double(), *args[1:5], args[5].double(), args[6], act_dtype=dtype)
    assert rel_err(free, want) > 0.05  # the clamp bites on both sides at this limit
    check(*args, limit=1e4)  # far outside: the same as no clamp


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_experts_and_one_hot_expert(dtype):
    gen = torch.Generator().manual_seed(1)
    T, E, k = 40, 8, 2
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(T)]) + 1
    ids[:, 0] = 3  # expert 3 holds every token (3 tiles of 16 rows); experts 0 and 7 hold none
    ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    check(*make(T, E, k, 64, 32, dtype, gen, ids=ids))


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_k_matches_reference(splits):
    """K split over programs (decode's small grids): w13's float32 gate | up partials summed by
    `_swiglu_kernel` (clamp included), w2's partials summed with the top-k sum; uneven last
    splits (hidden 200 = 3 x 64 + 8, I = 96 = 64 + 32) and one split (the fused epilogue)."""
    gen = torch.Generator().manual_seed(20 + splits)
    dtype = torch.float16 if splits == 2 else torch.float32
    cfg = configs.MoEConfig(16, 32, 64, 4, 1, split_k=splits)
    check(*make(5, 4, 2, 200, 96, dtype, gen), limit=0.5, config=cfg)


def test_split_rule_splits_only_small_grids():
    """K is split when the grid has under 2 programs per SM, into whole K steps; a config's
    split_k wins. sm_count is 4 on the CPU."""
    from pdserve_kernels.fused_moe_fp4 import split_k

    auto = configs.MoEConfig(16, 64, 128, 4, 3)
    assert split_k(8, 4096, 128, auto, torch.device("cpu")) == (1, 4096)  # 2 per SM already
    sp, ks = split_k(2, 4096, 128, auto, torch.device("cpu"))  # 0.5 per SM: 8 splits
    assert (sp, ks) == (8, 512)
    assert split_k(2, 200, 64, auto, torch.device("cpu")) == (4, 64)  # no more splits than steps
    assert split_k(1000, 4096, 128, dataclasses.replace(auto, split_k=3), torch.device("cpu")) == (3, 1408)


def test_checkpoint_dtypes_are_taken_as_their_bytes():
    """transformers stores the packed experts as int8 and ue8m0 scales as float8_e8m0fnu."""
    gen = torch.Generator().manual_seed(2)
    x, q13, q2, s13, s2, tw, ids = make(3, 4, 2, 64, 32, torch.float32, gen)
    y = fused_moe_fp4(x, q13, q2, s13, s2, tw, ids)
    e8 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    y2 = fused_moe_fp4(x, q13.view(torch.int8), q2.view(torch.int8), s13.view(e8), s2.view(e8), tw, ids)
    assert torch.equal(y, y2)


@pytest.mark.parametrize("T", [48, 160])
def test_larger_batches_use_the_larger_tiles(T):
    """On the GPU these pick the 64 and the largest rows-per-expert tiles (BM 32 / 64)."""
    gen = torch.Generator().manual_seed(T)
    cuda = DEVICE == "cuda"
    hidden, inter = (256, 128) if cuda else (64, 32)
    check(*make(T, 4, 2, hidden, inter, torch.bfloat16 if cuda else torch.float16, gen))


@pytest.mark.skipif(DEVICE != "cuda", reason="tl.dot_scaled does not run in the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_scaled_variant_matches_reference(dtype):
    gen = torch.Generator().manual_seed(12)
    for block_m, block_k in ((16, 128), (32, 64)):
        cfg = configs.MoEConfig(block_m, 64, block_k, 4, 3, dot_scaled=True)
        check(*make(9, 6, 2, 192, 96, dtype, gen), limit=2.0, config=cfg)


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    x, q13, q2, s13, s2, tw, ids = make(2, 4, 2, 64, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="w13_scale must be ue8m0"):
        fused_moe_fp4(x, q13, q2, s13[:, :, :1], s2, tw, ids)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe_fp4(x, q13, q2, s13, s2.float(), tw, ids)
    with pytest.raises(ValueError, match="packed bytes"):
        fused_moe_fp4(x, q13.float(), q2, s13, s2, tw, ids)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe_fp4(x[:, :32], q13, q2, s13, s2, tw, ids)
    with pytest.raises(ValueError, match="multiple of the 32"):
        fused_moe_fp4(x, q13, q2, s13, s2, tw, ids, config=configs.MoEConfig(16, 32, 48, 4, 1))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="dot_scaled"):
            cfg = dataclasses.replace(configs.MOE_FP4[configs.CPU][10**9], dot_scaled=True)
            fused_moe_fp4(x, q13, q2, s13, s2, tw, ids, config=cfg)
