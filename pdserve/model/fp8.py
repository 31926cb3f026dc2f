"""Block-scaled FP8 (e4m3) weights, as DeepSeek ships them, dequantized or kept FP8.

A weight W [N, K] is stored as e4m3 values plus `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
float32, one scale per (bn x bk) block (128 x 128 in DeepSeek's checkpoints); the real weight is
W_fp8 * scale_inv of its block (the last row/column blocks may be partial).

Kept FP8 (the default for an FP8 checkpoint, `--quantization`), a linear layer holds both tensors
under the checkpoint's names and multiplies through `ops.fp8_linear` (on CUDA kernels/fp8_gemm.py,
which hands decode rows, M <= 16, to the GEMV of kernels/fp8_gemv.py; the torch reference elsewhere): `Fp8Linear` for replicated layers, and the tensor-parallel
linears of parallel.py when given a block (`fp8_block`). Their shards cut both tensors at the same
place, which must fall on a block edge (`shard_scales`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.model import ops

if TYPE_CHECKING:
    from pdserve.model.config import ModelConfig

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8 = torch.float8_e4m3fn
Block = tuple[int, int]


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] e4m3, scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]. Raises ValueError
    on shapes that do not fit the block size."""
    if weight.dim() != 2:
        raise ValueError(f"block-scaled fp8 weights must be 2-D, got shape {tuple(weight.shape)}")
    (N, K), (bn, bk) = weight.shape, block
    expected = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not fit weight {(N, K)} with "
            f"blocks {block}: expected {expected}"
        )
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return weight.float() * scale


def fp8_params(
    out_features: int, in_features: int, block: Block, lead: tuple[int, ...] = ()
) -> tuple[nn.Parameter, nn.Parameter]:
    """(weight [*lead, N, K] e4m3, weight_scale_inv [*lead, ceil(N/bn), ceil(K/bk)] float32), empty."""
    (bn, bk) = block
    w = torch.empty(*lead, out_features, in_features, dtype=FP8)
    s = torch.empty(*lead, -(-out_features // bn), -(-in_features // bk), dtype=torch.float32)
    return nn.Parameter(w, requires_grad=False), nn.Parameter(s, requires_grad=False)


def check_block_shard(n: int, size: int, block_dim: int, what: str) -> None:
    """A shard of n rows (or columns) per rank must start and end on a block edge (ValueError)."""
    if size > 1 and n % block_dim:
        raise ValueError(
            f"{what}: {n} per rank (tensor_parallel_size {size}) cuts the FP8 weights' {block_dim}-wide scale "
            f"blocks; use a tensor_parallel_size whose shards are multiples of {block_dim}, or --quantization none"
        )


def shard_scales(scale: torch.Tensor, dim: int, start: int, n: int, block_dim: int) -> torch.Tensor:
    """The scale blocks of the weight slice [start, start+n) along dim (block-aligned: check_block_shard)."""
    return scale.narrow(dim, start // block_dim, -(-n // block_dim))


class Fp8Linear(nn.Module):
    """y = x W^T (+ b), W [out, in] kept e4m3 with its block scales (checkpoint names `weight`,
    `weight_scale_inv`); replicated on every tensor-parallel rank."""

    def __init__(self, in_features: int, out_features: int, block: Block, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fp8_block = in_features, out_features, tuple(block)
        self.weight, self.weight_scale_inv = fp8_params(out_features, in_features, self.fp8_block)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, self.bias)


def linear(in_features: int, out_features: int, bias: bool = False, fp8_block: Block | None = None) -> nn.Module:
    """A replicated linear layer: nn.Linear, or Fp8Linear when the weights stay FP8."""
    if fp8_block is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, fp8_block, bias=bias)


# --quantization (vLLM's flag): None follows the checkpoint (an FP8 quantization_config: kept FP8);
# "fp8" asks for FP8 weights (a checkpoint without one is refused: no online quantization; with
# load_format dummy the random weights are made FP8); "none" dequantizes FP8 weights at load into
# the model dtype (debugging: the same numbers, 2-4x the memory)
QUANTIZATIONS = ("fp8", "none")
# the kernel path of FP4 experts (engine/config.py's fp4_moe_backend; ops.fused_moe_fp4)
FP4_MOE_BACKENDS = ("auto", "w4a16", "mxfp8")


def model_config_for(
    config: ModelConfig, quantization: str | None, dummy: bool = False, fp4_moe_backend: str = "auto"
) -> ModelConfig:
    """The config to build the model from: `quant` kept (FP8 layers) or None (dequantized at
    load), FP4 experts' kernel path (`fp4_moe_backend`, engine/config.py) in it. Raises ValueError
    on a combination that cannot hold."""
    import dataclasses

    if fp4_moe_backend not in FP4_MOE_BACKENDS:
        raise ValueError(f"fp4_moe_backend {fp4_moe_backend!r}: choose one of {', '.join(FP4_MOE_BACKENDS)}")
    config = _for_quantization(config, quantization, dummy)
    if config.quant is None or config.quant.expert_dtype != "fp4":
        return config  # no FP4 experts: the choice has nothing to act on
    return dataclasses.replace(config, quant=dataclasses.replace(config.quant, fp4_moe_backend=fp4_moe_backend))


def _for_quantization(config: ModelConfig, quantization: str | None, dummy: bool) -> ModelConfig:
    import dataclasses

    from pdserve.model.config import QuantConfig

    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization {quantization!r}: choose fp8 or none, or leave it unset (follow the checkpoint)"
        )
    if quantization == "none":
        return dataclasses.replace(config, quant=None)
    if config.quant is None and quantization == "fp8":
        if not dummy:
            raise ValueError(
                "quantization fp8: the checkpoint has no FP8 quantization_config in its config.json and "
                "pdserve does not quantize at load; leave --quantization unset for its own weights"
            )
        return dataclasses.replace(config, quant=QuantConfig(method="fp8"))
    return config
