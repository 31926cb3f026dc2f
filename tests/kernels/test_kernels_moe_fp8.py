"""FP8 block-scaled fused MoE (e4m3 weights with weight_scale_inv, per-token-group e4m3
activations) against its float64 reference.

Runs under the Triton interpreter without CUDA (see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set before the first triton import). The interpreter multiplies e4m3 tiles
correctly but rounds float32 -> e4m3 wrongly at binade edges, so the kernel rounds by hand there
(`_round_e4m3`, checked exhaustively below); on the GPU the hardware conversion runs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pdserve_kernels import configs, ref_fp8  # noqa: E402
from pdserve_kernels.fused_moe import fused_moe  # noqa: E402
from pdserve_kernels.fused_moe_fp8 import _round_e4m3, fused_moe_fp8  # noqa: E402
from pdserve_kernels.ref import fused_moe_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, poisoned_empty, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()

# On the GPU a float32 division may round differently from torch's in the last bit, which can
# move one activation to the next e4m3 value (1/16 relative): allow for a few such elements.
# float32 x is not quantized (the parity path: e4m3 weights upcast, IEEE dots).
FP8_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make(T, E, k, hidden, inter, block, dtype, gen, ids=None):
    x = torch.randn(T, hidden, generator=gen).to(DEVICE, dtype)
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=gen) * inter**-0.5
    w13[:, :, : hidden // 3] *= 8  # blocks with different scales
    q13, s13 = ref_fp8.quant_block_fp8(w13, block)
    q2, s2 = ref_fp8.quant_block_fp8(w2, block)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen).to(DEVICE)
    dev = [t.to(DEVICE) for t in (q13, q2, s13, s2)]
    return x, *dev, weights, ids.to(DEVICE, torch.int32)


def check(x, q13, q2, s13, s2, weights, ids, block, dtype, config=None):
    with poisoned_empty():
        y = fused_moe_fp8(x, q13, q2, s13, s2, weights, ids, block_shape=block, config=config)
    want = ref_fp8.fused_moe_fp8_ref(
        x.double(),
        q13,
        q2,
        s13,
        s2,
        weights.double(),
        ids,
        block_shape=block,
        act_dtype=x.dtype,
        act_quant=x.dtype != torch.float32,
    )
    assert y.dtype == x.dtype and y.shape == x.shape
    assert not y.isnan().any()
    err = ((y.double() - want).norm() / want.norm()).item()
    assert err < FP8_TOL[dtype], f"relative error {err:.2e} ({dtype})"


# (T, E, k, hidden, I, (bn, bk)): T = 1, hidden not a multiple of bk (partial last group),
# DeepSeek's 128 x 128 blocks, more experts than pairs.
SHAPES = [
    (1, 8, 2, 64, 32, (32, 32)),
    (7, 6, 3, 80, 64, (32, 32)),
    (3, 4, 2, 256, 128, (128, 128)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    *dims, block = shape
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    check(*make(*dims, block, dtype, gen), block, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_experts_and_one_hot_expert(dtype):
    gen = torch.Generator().manual_seed(1)
    T, E, k = 40, 8, 2
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(T)]) + 1
    ids[:, 0] = 3  # expert 3 holds every token (3 tiles of 16 rows); experts 0 and 7 hold none
    ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    check(*make(T, E, k, 64, 32, (32, 32), dtype, gen, ids=ids), (32, 32), dtype)


@pytest.mark.parametrize("T", [48, 160])
def test_larger_batches_use_the_larger_tiles(T):
    """On the GPU these pick the 64 and the largest rows-per-expert tiles (BM 32 / 64)."""
    gen = torch.Generator().manual_seed(T)
    cuda = DEVICE == "cuda"
    hidden, inter, block = (256, 128, (128, 128)) if cuda else (64, 32, (32, 32))
    dtype = torch.bfloat16 if cuda else torch.float16
    check(*make(T, 4, 2, hidden, inter, block, dtype, gen), block, dtype)


def test_fp8_is_close_to_the_unquantized_moe_and_dispatches():
    """fused_moe / fused_moe_ref take fp8 weights with scales and route to the fp8 path; the
    result is within e4m3's error of the bf16-weight MoE it quantizes."""
    gen = torch.Generator().manual_seed(4)
    T, E, k, hidden, inter, block = 6, 4, 2, 64, 64, (32, 32)
    x = torch.randn(T, hidden, generator=gen).to(DEVICE)
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=gen) * inter**-0.5
    (q13, s13), (q2, s2) = ref_fp8.quant_block_fp8(w13, block), ref_fp8.quant_block_fp8(w2, block)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int().to(DEVICE)
    tw = torch.rand(T, k, generator=gen).to(DEVICE)
    q13, q2, s13, s2 = (t.to(DEVICE) for t in (q13, q2, s13, s2))
    kw = dict(w13_scale_inv=s13, w2_scale_inv=s2, block_shape=block)
    y = fused_moe(x, q13, q2, tw, ids, **kw)
    y_ref = fused_moe_ref(x, q13, q2, tw, ids, **kw)
    exact = fused_moe_ref(x.double(), w13.double().to(DEVICE), w2.double().to(DEVICE), tw.double(), ids)
    assert ((y.double() - y_ref.double()).norm() / y_ref.double().norm()).item() < 2e-3
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.12, err  # e4m3 keeps 3 mantissa bits: a few percent, never exact
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        fused_moe(x, w13.to(DEVICE), w2.to(DEVICE), tw, ids, **kw)


def test_activation_quantization_matches_deepseek():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 300, generator=gen) * torch.logspace(-3, 3, 300)
    x[2] = 0.0  # an all-zero row: finite scale, zero values
    q, s = ref_fp8.quant_act_groups(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, 3)
    groups = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128)
    torch.testing.assert_close(s, groups.abs().amax(-1).clamp(min=1e-10) / 448.0)
    assert q.float().abs().amax().item() == 448.0  # each group's largest value maps to e4m3's max
    back = ref_fp8.dequant_act_groups(q, s, 128, torch.float32)
    assert torch.equal(back[2], torch.zeros(300))
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[x.abs() > s.repeat_interleave(128, 1)[:, :300] * 2**-6]
    assert rel.max().item() <= 2**-4 + 1e-6  # normal e4m3 values: half a unit in the last place


@triton.jit
def _roundtrip(a_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n, other=0.0)
    tl.store(o_ptr + offs, _round_e4m3(a).to(tl.float8e4nv).to(tl.float32), mask=offs < n)


def test_in_kernel_rounding_matches_torch_e4m3():
    """Every e4m3 value, every midpoint between neighbours (ties to even), random values."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    gen = torch.Generator().manual_seed(6)
    a = (
        torch.cat(
            [
                vals,
                (vals[1:] + vals[:-1]) / 2,
                torch.randn(4096, generator=gen) * 50,
                torch.randn(4096, generator=gen) * 0.01,
            ]
        )
        .clamp(-448, 448)
        .to(DEVICE)
    )
    out = torch.empty_like(a)
    _roundtrip[(triton.cdiv(a.numel(), 1024),)](a, out, a.numel(), BLOCK=1024)
    assert torch.equal(out, a.to(torch.float8_e4m3fn).float())


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    x, q13, q2, s13, s2, tw, ids = make(2, 4, 2, 64, 32, (32, 32), torch.float32, gen)
    with pytest.raises(ValueError, match="w13_scale_inv must be float32"):
        fused_moe_fp8(x, q13, q2, s13[:, :1], s2, tw, ids, block_shape=(32, 32))
    with pytest.raises(ValueError, match="w2_scale_inv"):
        fused_moe_fp8(x, q13, q2, s13, None, tw, ids, block_shape=(32, 32))
    with pytest.raises(ValueError, match="multiple of the weight block"):
        fused_moe_fp8(x, q13, q2, s13, s2, tw, ids, block_shape=(64, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8(x, q13.float(), q2, s13, s2, tw, ids, block_shape=(32, 32))


def test_sm120_configs_fit_shared_memory():
    for rows_per_expert in (0.01, 1, 16, 17, 64, 1000):
        cfg = configs.moe_fp8_config(120, rows_per_expert)
        assert configs.moe_fp8_smem_bytes(cfg) <= configs.SMEM_LIMIT[120], cfg
        big = configs.moe_fp8_config(90, rows_per_expert)
        assert configs.moe_fp8_smem_bytes(big) <= configs.SMEM_LIMIT[90], big
