"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4, as transformers 5.24 computes them.

Legend: T tokens, N residual streams (hc_mult), D hidden size.

The residual is N parallel streams h [T, N, D]. Before a block (attention or MoE) a small
projection of all streams gives three mixes per token: `pre` [T, N] collapses the streams into
the block's input, `post` [T, N] spreads the block's output back over the streams, and `comb`
[T, N, N] mixes the old streams into the new ones; comb is pushed towards a doubly-stochastic
matrix by Sinkhorn-Knopp iterations, all in float32. On a GPU `ops.hc_pre` is two kernels (the
projection split over N*D, then gates + Sinkhorn + the collapse + the block's input RMSNorm) and
`ops.hc_post` one (kernels/mhc.py), where PyTorch takes ~140 launches a hyper-connection:

    h' = post[:, :, None] * block(sum_n pre[:, n] h[:, n]) [:, None, :] + comb^T @ h

`HyperHead` collapses the streams once more, with `pre` weights only, before the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import ops
from pdserve.model.deepseek_v4.layers import V4RMSNorm


class HyperConnection(nn.Module):
    """Parameters as the checkpoint names them: fn [(2+N)*N, N*D], base [(2+N)*N], scale [3]
    (pre, post, comb), all float32."""

    def __init__(self, hidden: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(
        self, h: torch.Tensor, norm: V4RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, N, D] -> post [T, N], comb [T, N, N] (float32) and the block input [T, D]
        (passed through `norm`, the block's input RMSNorm, when given: fused on a GPU)."""
        w, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        return ops.hc_pre(
            h, self.fn.float(), self.base.float(), self.scale.float(), self.iters, self.hc_eps, self.norm_eps, w, eps
        )


def hc_residual(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out2: torch.Tensor | None = None
) -> torch.Tensor:
    """New streams [T, N, D] from the old h [T, N, D], the block output [T, D] (out + out2 when
    given: added inside hc_post's kernel on a GPU) and the mixes."""
    return ops.hc_post(h, out, post, comb, out2)


class HyperHead(nn.Module):
    """Final collapse of the N streams: hc_fn [N, N*D], hc_base [N], hc_scale [1] (float32)."""

    def __init__(self, hidden: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor, norm: V4RMSNorm | None = None) -> torch.Tensor:
        """h [T, N, D] -> [T, D]: pre = sigmoid(mixes * hc_scale + hc_base) + hc_eps, the streams
        collapsed by pre (then `norm`, the final RMSNorm, when given: fused on a GPU)."""
        w, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        fn, base, scale = self.hc_fn.float(), self.hc_base.float(), self.hc_scale.float()
        return ops.hc_pre(h, fn, base, scale, 0, self.hc_eps, self.norm_eps, w, eps)[2]
