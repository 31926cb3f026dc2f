"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4, as transformers 5.24 computes them.

Legend: T tokens, N residual streams (hc_mult), D hidden size.

The residual is N parallel streams h [T, N, D]. Before a block (attention or MoE) a small
projection of all streams gives three mixes per token: `pre` [T, N] collapses the streams into
the block's input, `post` [T, N] spreads the block's output back over the streams, and `comb`
[T, N, N] mixes the old streams into the new ones; comb is pushed towards a doubly-stochastic
matrix by Sinkhorn-Knopp iterations, all in float32 (`ops.hc_mix`: one kernel on a GPU, where PyTorch
takes ~115 launches a hyper-connection):

    h' = post[:, :, None] * block(sum_n pre[:, n] h[:, n]) [:, None, :] + comb^T @ h

`HyperHead` collapses the streams once more, with `pre` weights only, before the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import ops
from pdserve.model.deepseek_v4.layers import rms_norm


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

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, N, D] -> post [T, N], comb [T, N, N] (float32) and the block input [T, D]."""
        mixes = F.linear(rms_norm(h.flatten(1).float(), self.norm_eps), self.fn.float())  # [T, (2+N)*N]
        pre, post, comb = ops.hc_mix(
            mixes, self.base, self.scale, self.n, self.iters, self.hc_eps
        )  # one kernel on a GPU
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
        return post, comb, collapsed


def hc_residual(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D] from the old h [T, N, D], the block output [T, D] and the mixes."""
    return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """Final collapse of the N streams: hc_fn [N, N*D], hc_base [N], hc_scale [1] (float32)."""

    def __init__(self, hidden: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, N, D] -> [T, D]."""
        mixes = F.linear(rms_norm(h.flatten(1).float(), self.norm_eps), self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
