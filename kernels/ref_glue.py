"""PyTorch references of DeepSeek-V4's per-layer glue, in transformers' order of operations and
roundings: what the CPU runs and what the fused kernels (kernels/mhc.py, kernels/glue.py) are
tested against. Every intermediate is rounded to the model dtype where transformers rounds it
(a bf16 model's router scores, norm scales and products are bf16 tensors there).

Legend: T tokens, N residual streams (hc_mult), D hidden (or a row's features), R rope dims (the
trailing R of D), E routed experts, k experts a token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve_kernels.ref import hc_mix_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] -> RMSNorm over D. weight None: layers.rms_norm (the scale rounded to x's
    dtype before the product); weight [D] float32: V4RMSNorm (weight * normed, in float32)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def rope_tail_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D]; cos/sin [T, R/2] float32 -> x with its last R dims rotated as interleaved
    pairs (x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin), in float32."""
    R = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (R,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)  # [T, ..., R]
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, rope = x[..., :-R], x[..., -R:]
    pairs = rope.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
    rotated = (rope.float() * c + rotated_half.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def hc_pre_ref(
    h: torch.Tensor,  # [T, N, D]
    fn: torch.Tensor,  # [(2+N)*N, N*D] float32 (HyperHead: [N, N*D])
    base: torch.Tensor,  # [(2+N)*N] float32 (HyperHead: [N])
    scale: torch.Tensor,  # [3] float32 (HyperHead: [1])
    iters: int,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor | None = None,  # [D] float32: the block's input RMSNorm
    out_eps: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """A hyper-connection before its block: post [T, N], comb [T, N, N] (float32) and the block
    input [T, D] in h's dtype (sum_n pre[:, n] h[:, n], RMSNorm'd by norm_weight when given).
    A head (fn of N rows: HyperHead) has pre gates only and returns (None, None, input)."""
    n = h.shape[1]
    x = h.flatten(1).float()
    mixes = F.linear(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps), fn.float())
    if fn.shape[0] == n:  # the head: sigmoid gates, no post, no comb
        pre, post, comb = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps, None, None
    else:
        pre, post, comb = hc_mix_ref(mixes, base, scale, n, iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
    if norm_weight is not None:
        collapsed = rms_norm_ref(collapsed, norm_weight, out_eps)
    return post, comb, collapsed


def hc_post_ref(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D] from the old h [T, N, D], the block output [T, D] and the mixes:
    post[:, :, None] * out[:, None, :] + comb^T @ h, in h's dtype."""
    return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


def route_ref(
    logits: torch.Tensor,  # [T, E], the router's x W^T in the model dtype
    top_k: int,
    scoring: str,  # "sqrtsoftplus" | "sigmoid"
    scaling: float,
    bias: torch.Tensor | None = None,  # [E] float32 e_score_correction_bias (learned top-k)
    table: torch.Tensor | None = None,  # [vocab, k] int64 tid2eid (hash routing)
    input_ids: torch.Tensor | None = None,  # [T] int64 (hash routing)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [T, k] (logits' dtype) and expert ids [T, k] int64: scores, the top-k of
    scores + bias (or the table's row of each token), weights = chosen scores / their sum * scaling."""
    scores = F.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else torch.sigmoid(logits)
    if table is not None:
        ids = table[input_ids]
    else:
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU: silu(gate clamped to <= limit) * up clamped to [-limit, limit]."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
