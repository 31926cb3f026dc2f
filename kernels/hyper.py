"""DeepSeek-V4's hyper-connection mixes in one kernel: gates and Sinkhorn-Knopp iterations in registers.

    mixes [T, (2+N)*N] (float32, the projection of the normalized streams) -> pre [T, N], post [T, N],
    comb [T, N, N]; every token's N x N matrix stays in registers through all `iters` normalizations.

In PyTorch each Sinkhorn iteration is a sum, an add and a divide per axis: with 20 iterations, two
hyper-connections a layer and N = 4, ~230 launches of a few hundred bytes a layer, the largest
kernel class of a V4 decode step. Same arithmetic as `ref.hc_mix_ref` (float32), except the
order of additions within a 4-term sum and Triton's exp.

Legend: T tokens, N residual streams (hc_mult, a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv

BLOCK_T = 16  # tokens a program: 16 x N x N float32 values in registers


@triton.jit
def _hc_mix_kernel(
    mixes_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_m, eps,
    N: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, N)
    t_ok = t < T
    row = mixes_ptr + t.to(tl.int64)[:, None] * stride_m  # [BT, 1]
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)

    mask2 = t_ok[:, None]
    pre = tl.load(row + n[None, :], mask=mask2, other=0.0) * s_pre + tl.load(base_ptr + n)[None, :]
    post = tl.load(row + N + n[None, :], mask=mask2, other=0.0) * s_post + tl.load(base_ptr + N + n)[None, :]
    out2 = t.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(pre_ptr + out2, tl.sigmoid(pre) + eps, mask=mask2)
    tl.store(post_ptr + out2, 2.0 * tl.sigmoid(post), mask=mask2)

    ij = n[:, None] * N + n[None, :]  # [N, N]: row i, column j of a token's matrix
    mask3 = t_ok[:, None, None]
    x = tl.load(row[:, :, None] + 2 * N + ij[None, :, :], mask=mask3, other=0.0) * s_comb
    x = x + tl.load(base_ptr + 2 * N + ij)[None, :, :]
    x = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    comb = x / tl.sum(x, axis=2)[:, :, None] + eps  # softmax over j, + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
    tl.store(comb_ptr + t.to(tl.int64)[:, None, None] * (N * N) + ij[None, :, :], comb, mask=mask3)


def hc_mix(
    mixes: torch.Tensor,  # [T, (2+N)*N] float32, last dim contiguous
    base: torch.Tensor,  # [(2+N)*N] float32
    scale: torch.Tensor,  # [3] float32: pre, post, comb
    n: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [T, N], post [T, N], comb [T, N, N] (float32), as `ref.hc_mix_ref`."""
    T = mixes.shape[0]
    if n & (n - 1) or mixes.shape[1] != (2 + n) * n or mixes.stride(1) != 1:
        raise ValueError(
            f"hc_mix: mixes {tuple(mixes.shape)} (stride {mixes.stride()}) for hc_mult {n}: want [T, {(2 + n) * n}], N a power of two"
        )
    if iters < 1:
        raise ValueError(f"hc_mix: iters must be >= 1, got {iters}")
    mixes, base, scale = mixes.float(), base.float().contiguous(), scale.float().contiguous()
    pre = mixes.new_empty(T, n)
    post = mixes.new_empty(T, n)
    comb = mixes.new_empty(T, n, n)
    if T:
        _hc_mix_kernel[(cdiv(T, BLOCK_T),)](
            mixes, base, scale, pre, post, comb, T, mixes.stride(0), eps, N=n, ITERS=iters, BLOCK_T=BLOCK_T
        )
    return pre, post, comb
