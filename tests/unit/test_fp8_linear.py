"""The FP8 linear layers (model/fp8.py, parallel.py with fp8_block) on the torch reference path:
equal to dequantizing at load, bit for bit in float32; sharded with their scale blocks; a shard
that cuts a block is refused."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.distributed.group import TPGroup
from pdserve.model.fp8 import Fp8Linear, dequantize_block_fp8, linear
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear
from pdserve_kernels.ref_fp8 import quant_block_fp8


def _quantized(n: int, k: int, block, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w[: n // 2] *= 10  # row blocks with different scales
    return quant_block_fp8(w, block)


def test_fp8_linear_equals_dequantized_at_load():
    block, (n, k) = (32, 32), (75, 113)  # partial blocks both ways
    q, s = _quantized(n, k, block)
    layer = Fp8Linear(k, n, block, bias=True)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    layer.bias.data.normal_()
    x = torch.randn(3, 5, k)  # leading dims are kept
    want = F.linear(x, dequantize_block_fp8(q, s, block), layer.bias)
    assert torch.equal(layer(x), want)
    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight_scale_inv.shape) == (3, 4)
    assert isinstance(linear(k, n, fp8_block=None), torch.nn.Linear)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp_shards_cut_weight_and_scales_together(kind):
    """Two ranks' FP8 shards, each through its own layer, add up (row) or concatenate (column) to
    the unsharded layer's output."""
    block, (n, k) = (32, 32), (128, 192)
    q, s = _quantized(n, k, block, seed=1)
    x = torch.randn(4, k)
    want = F.linear(x, dequantize_block_fp8(q, s, block))
    outs = []
    for rank in range(2):
        tp = TPGroup(rank=rank, size=2)
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        layer = cls(k, n, tp, fp8_block=block, **({} if kind == "column" else {"reduce": False}))
        for name in ("weight", "weight_scale_inv"):
            getattr(layer, name).data.copy_(layer.shard_weight(name, q if name == "weight" else s))
        xr = x if kind == "column" else x[:, rank * k // 2 : (rank + 1) * k // 2]
        outs.append(layer(xr))
    got = torch.cat(outs, dim=1) if kind == "column" else outs[0] + outs[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shard_cutting_a_block_is_refused():
    with pytest.raises(ValueError, match=r"q heads: 48 per rank .* cuts the FP8 weights' 32-wide scale blocks"):
        ColumnParallelLinear(64, 96, TPGroup(rank=0, size=2), what="q heads", fp8_block=(32, 32))
    with pytest.raises(ValueError, match="80 per rank"):
        RowParallelLinear(160, 64, TPGroup(rank=1, size=2), what="o_proj heads", fp8_block=(128, 128))
    ColumnParallelLinear(64, 96, TPGroup(rank=0, size=1), fp8_block=(32, 32))  # one rank: partial blocks are fine
