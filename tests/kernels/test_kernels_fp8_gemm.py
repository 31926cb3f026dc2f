"""Block-scaled FP8 GEMM (`fp8_gemm.fp8_linear`: e4m3 weights with weight_scale_inv) against its
float64 reference, both paths (w8a16 and fp8 activations), split-K, bias, partial blocks.

Runs under the Triton interpreter without CUDA (TRITON_INTERPRET is set before the first triton
import: see test_kernels_sparse_mla.py); on a GPU the same tests run compiled, plus bf16.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import configs, ref_fp8  # noqa: E402
from pdserve_kernels._launch import capability  # noqa: E402
from pdserve_kernels.fp8_gemm import fp8_linear, splits_for  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, REL_TOL, poisoned_empty, rel_err, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()

# the fp8-activation path: a float32 division on the GPU may round differently from torch's in the
# last bit and move one activation to the next e4m3 value (1/16 relative)
ACT_TOL = {torch.float16: 3e-3 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 2e-2}


def make(M, N, K, block, dtype, gen, bias=False):
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=gen) * K**-0.5
    w[: N // 3, : K // 2] *= 16  # blocks with different scales
    q, s = ref_fp8.quant_block_fp8(w, block)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype) if bias else None
    return x, q.to(DEVICE), s.to(DEVICE), b


def check(M, N, K, block, dtype, seed, bias=False, config=None, act_quant=False):
    x, q, s, b = make(M, N, K, block, dtype, torch.Generator().manual_seed(seed), bias)
    with poisoned_empty():
        y = fp8_linear(x, q, s, block, bias=b, config=config)
    want = ref_fp8.fp8_linear_ref(x.double(), q, s, block, bias=b, act_quant=act_quant)
    assert y.dtype == dtype and y.shape == (M, N)
    assert not y.isnan().any(), "an output element was not written"
    err = rel_err(y, want)
    tol = ACT_TOL[dtype] if act_quant else REL_TOL[dtype]
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e} ({dtype}, {M}x{N}x{K}, block {block})"


# (M, N, K, block): M = 1 (decode), odd M/N/K, K not a multiple of bk (a partial last group),
# N not a multiple of bn (partial row blocks), DeepSeek's 128 x 128 blocks, non-square blocks
SHAPES = [
    (1, 96, 160, (32, 32)),
    (7, 75, 113, (32, 32)),
    (19, 130, 200, (128, 128)),
    (33, 61, 96, (16, 64)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    """The tile config the wrapper picks for M: where it quantizes the activations to FP8 (small M
    on a GPU), against the reference that quantizes them the same way."""
    *dims, block = shape
    cfg = configs.fp8_gemm_config(capability(torch.device(DEVICE)), dims[0], dtype)
    check(*dims, block, dtype, seed=sum(dims), config=cfg, act_quant=cfg.fp8_act)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_and_bias(dtype):
    """A small grid splits K (partials summed by the second kernel, bias added once there); the
    same shape unsplit adds the bias in the GEMM kernel."""
    split = configs.Fp8GemmConfig(16, 32, 32, 4, 1, split_k=True, waves=8)
    whole = dataclasses.replace(split, split_k=False)
    assert splits_for(tiles=2, k_blocks=9, sms=4, waves=8) == 9
    for cfg in (split, whole):
        check(5, 40, 280, (32, 32), dtype, seed=3, bias=True, config=cfg)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("shape", [(9, 70, 150, (32, 32)), (3, 64, 256, (128, 128))])
def test_fp8_activations(shape, dtype):
    """The large-M path: x quantized per token and per bk values, e4m3 x e4m3 dots."""
    *dims, block = shape
    cfg = configs.Fp8GemmConfig(16, 32, block[1], 4, 1, fp8_act=True, waves=8)
    check(*dims, block, dtype, seed=sum(dims), bias=True, config=cfg, act_quant=True)


def test_empty_and_bad_inputs():
    x, q, s, _ = make(0, 8, 32, (32, 32), torch.float32, torch.Generator().manual_seed(0))
    assert fp8_linear(x, q, s, (32, 32)).shape == (0, 8)
    with pytest.raises(ValueError, match="weight_scale_inv must be float32"):
        fp8_linear(torch.zeros(1, 32, device=DEVICE), q, s[:, :0], (32, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.zeros(1, 32, device=DEVICE), q.float(), s, (32, 32))


def test_configs_respect_shared_memory_and_buckets():
    for cc in (90, 120):
        for table in configs.FP8_GEMM[cc].values():
            assert 128 % table.block_k == 0
        assert configs.fp8_gemm_config(cc, 1).block_m == 16
        assert configs.fp8_gemm_config(cc, 64).fp8_act and configs.fp8_gemm_config(cc, 4096).dequant
    assert configs.fp8_gemm_config(90, 4096, torch.float32) is configs.FP8_GEMM_FP32


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_dequantize_then_matmul(dtype):
    """The large-M path: the weight dequantized by `_dequant_kernel` (partial blocks), then torch."""
    cfg = configs.Fp8GemmConfig(16, 32, 32, 4, 1, dequant=True)
    check(37, 75, 150, (32, 32), dtype, seed=11, bias=True, config=cfg)
