"""DeepSeek-V4's hyper-connections around a block, fused into three kernels (as `ref_glue.hc_pre_ref`
and `hc_post_ref` compute them, ~20 launches of PyTorch a hyper-connection otherwise):

  1. `_hc_project`: the streams' projection, split over K = N*D: each program sums x . fn and x . x
     over its K slice for BLOCK_T tokens (one tl.dot, float32 IEEE) into partials [S, T, M];
     the RMSNorm of the flattened streams is a per-token factor, applied in step 2.
  2. `_hc_pre`: two programs a token (one for the head): one sums the partials it needs and
     collapses the streams by the `pre` gates and, when given, applies the block's input RMSNorm,
     with the token's whole [N, D] row in registers (one load, no loop over D: such a loop of
     dependent loads and reductions made this step ~21 us a call at T = 1 on an H100); the other
     computes the `post` gates and `comb` by Sinkhorn-Knopp (as hyper.py's hc_mix) at the same
     time. Writes post [T, N], comb [T, N, N] and the block input [T, D]. Up to FUSE_T tokens (a
     one-sequence decode step) the projection's last split to arrive (an arrival counter, as the
     FP8 GEMV's) does both itself: two launches become one.
  3. `_hc_post`: the new streams post * out + comb^T @ h, over (token block, D block) tiles, rounded
     where PyTorch rounds (the products and the matmul in h's dtype, then their sum).

Legend: T tokens, N streams (hc_mult, a power of two), D hidden, K = N*D, M rows of fn ((2+N)*N,
or N for the head), S K-splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import arrival_counters, cdiv, next_pow2
from pdserve_kernels.glue import round_to

BLOCK_T, BLOCK_K = 16, 64  # projection tile (tl.dot's smallest M is 16)
PRE_VALUES = 64  # [N, D] values a thread holds in the collapse: N * D / 32 / 64 warps (4..16)
BLOCK_D = 256  # a `_hc_post` tile's N x features
POST_T = 4  # tokens a `_hc_post` tile
PROGRAMS = 256  # projection programs to aim for (K splits x token blocks)
# up to this many tokens the projection's last split to arrive runs `_hc_pre`'s work itself (one
# launch, not two: a decode step of one sequence); its one program walks the tokens in turn, so
# more tokens take the separate kernel's program a token
FUSE_T = 1


@triton.jit
def _hc_project(h_ptr, fn_ptr, dots_ptr, sq_ptr, cnt_ptr, base_ptr, scale_ptr, w_ptr, post_ptr, comb_ptr, x_ptr,
             T, norm_eps, hc_eps, out_eps, K: tl.constexpr, K_SPLIT: tl.constexpr, M: tl.constexpr,
             MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, FUSED: tl.constexpr,
             N: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, ITERS: tl.constexpr, BLOCK_D: tl.constexpr,
             HEAD: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(1)
    m = tl.arange(0, MP)
    t_ok = t < T
    acc = tl.zeros((BLOCK_T, MP), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = s * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(h_ptr + t.to(tl.int64)[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        w = tl.load(fn_ptr + m[None, :] * K + k[:, None], mask=(m < M)[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, w, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    rows = s * T + t.to(tl.int64)
    tl.store(dots_ptr + rows[:, None] * MP + m[None, :], acc, mask=t_ok[:, None])
    tl.store(sq_ptr + rows, sq, mask=t_ok)
    if FUSED > 0:  # the last split to arrive runs `_hc_pre`'s work for the step's FUSED tokens
        S = tl.num_programs(1)
        tl.debug_barrier()  # every thread's partial stores before the counter's release
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == S - 1:
            for i in tl.static_range(FUSED):  # FUSED <= BLOCK_T tokens: the whole step
                tok = tl.program_id(0) * BLOCK_T + i
                if tok < T:
                    _pre_token(tok.to(tl.int64), h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, post_ptr,
                               comb_ptr, x_ptr, T, S, norm_eps, hc_eps, out_eps, N, D, MP, SP, ITERS, BLOCK_D,
                               HEAD, NORM, ".cg")  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def _hc_pre(h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, post_ptr, comb_ptr, x_ptr, T, S,
         norm_eps, hc_eps, out_eps, N: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
         ITERS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:  # grid (T, 2) for a hyper-connection, (T, 1) for the head
        _mixes_token(t, dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, T, S, norm_eps, hc_eps,
                     N, D, MP, SP, ITERS, "")  # fmt: skip
    else:
        _collapse_token(t, h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, T, S, norm_eps, hc_eps,
                        out_eps, N, D, MP, SP, BLOCK_D, NORM, "")  # fmt: skip


@triton.jit
def _pre_token(t, h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, post_ptr, comb_ptr, x_ptr, T, S,
               norm_eps, hc_eps, out_eps, N: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
               ITERS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
               CACHE: tl.constexpr):  # fmt: skip
    """Token t's gates, Sinkhorn mix and block input from the S partials, in one program (CACHE
    ".cg": partials other programs of this launch wrote, read past the L1)."""
    if not HEAD:
        _mixes_token(t, dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, T, S, norm_eps, hc_eps,
                     N, D, MP, SP, ITERS, CACHE)  # fmt: skip
    _collapse_token(t, h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, T, S, norm_eps, hc_eps,
                    out_eps, N, D, MP, SP, BLOCK_D, NORM, CACHE)  # fmt: skip


@triton.jit
def _rms_factor(t, sq_ptr, T, S, norm_eps, N: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, CACHE: tl.constexpr):
    """1 / RMS of token t's flattened streams, from the S partial sums of squares."""
    s = tl.arange(0, SP)
    r = tl.sum(tl.load(sq_ptr + s * T + t, mask=s < S, other=0.0, cache_modifier=CACHE), axis=0)
    return tl.rsqrt(r / (N * D) + norm_eps)


@triton.jit
def _mixed(t, dots_ptr, T, S, first: tl.constexpr, N: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
           CACHE: tl.constexpr):  # fmt: skip
    """The sum over the S partials of token t's mixes first .. first + N - 1, [N]."""
    s = tl.arange(0, SP)
    n = tl.arange(0, N)
    rows = dots_ptr + (s * T + t) * MP
    return tl.sum(
        tl.load(rows[:, None] + first + n[None, :], mask=(s < S)[:, None], other=0.0, cache_modifier=CACHE), axis=0
    )


@triton.jit
def _mixes_token(t, dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, T, S, norm_eps, hc_eps,
                 N: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr, ITERS: tl.constexpr,
                 CACHE: tl.constexpr):  # fmt: skip
    """Token t's post gates [N] and Sinkhorn-Knopp comb [N, N]."""
    r = _rms_factor(t, sq_ptr, T, S, norm_eps, N, D, SP, CACHE)
    n = tl.arange(0, N)
    post = 2.0 * tl.sigmoid(_mixed(t, dots_ptr, T, S, N, N, MP, SP, CACHE) * r * tl.load(scale_ptr + 1)
                            + tl.load(base_ptr + N + n))  # fmt: skip
    tl.store(post_ptr + t * N + n, post)
    s = tl.arange(0, SP)
    rows = dots_ptr + (s * T + t) * MP
    ij = n[:, None] * N + n[None, :]  # [N, N]: row i, column j
    c = tl.load(
        rows[:, None, None] + 2 * N + ij[None, :, :], mask=(s < S)[:, None, None], other=0.0, cache_modifier=CACHE
    )
    c = tl.sum(c, axis=0) * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    comb = c / tl.sum(c, axis=1)[:, None] + hc_eps  # softmax over j, + eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)  # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    tl.store(comb_ptr + t * N * N + ij, comb)


@triton.jit
def _collapse_token(t, h_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, T, S, norm_eps, hc_eps,
                    out_eps, N: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                    BLOCK_D: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """Token t's block input [D]: its streams collapsed by the pre gates, RMSNorm'd when NORM; the
    whole [N, D] row in one load (BLOCK_D >= D), kept in registers for the norm."""
    r = _rms_factor(t, sq_ptr, T, S, norm_eps, N, D, SP, CACHE)
    n = tl.arange(0, N)
    pre = tl.sigmoid(_mixed(t, dots_ptr, T, S, 0, N, MP, SP, CACHE) * r * tl.load(scale_ptr) + tl.load(base_ptr + n))
    pre = pre + hc_eps  # [N]
    dt = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    hv = tl.load(h_ptr + t * N * D + n[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
    xv = round_to(tl.sum(pre[:, None] * hv.to(tl.float32), axis=0), dt)  # [BLOCK_D], as `.to(h.dtype)`
    if NORM:  # V4RMSNorm of the collapsed streams
        rr = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + out_eps)
        xv = round_to(tl.load(w_ptr + d, mask=d_ok, other=0.0) * (xv * rr), dt)
    tl.store(x_ptr + t * D + d, xv.to(dt), mask=d_ok)


@triton.jit
def _hc_post(h_ptr, out_ptr, out2_ptr, post_ptr, comb_ptr, new_ptr, T, N: tl.constexpr, D: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, N)
    t64 = t.to(tl.int64)
    ok = (t < T)[:, None] & (d < D)[None, :]  # [BT, BD]
    dt = new_ptr.dtype.element_ty
    o = tl.load(out_ptr + t64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    if TWO:  # the block's output is out + out2 (the MoE's routed and shared parts), rounded as torch adds
        o = round_to(o + tl.load(out2_ptr + t64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32), dt)
    p = tl.load(post_ptr + t64[:, None] * N + n[None, :], mask=(t < T)[:, None], other=0.0)
    p = round_to(p, dt)
    spread = round_to(p[:, :, None] * o[:, None, :], dt)  # [BT, N, BD]
    mixed = tl.zeros((BLOCK_T, N, BLOCK_D), tl.float32)
    for m in tl.static_range(N):  # comb^T @ h: new stream j gets sum_m comb[m, j] h[m]
        hm = tl.load(h_ptr + t64[:, None] * (N * D) + m * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        cm = tl.load(comb_ptr + t64[:, None] * (N * N) + m * N + n[None, :], mask=(t < T)[:, None], other=0.0)
        mixed += round_to(cm, dt)[:, :, None] * hm[:, None, :]
    new = round_to(spread + round_to(mixed, dt), dt)
    dst = new_ptr + t64[:, None, None] * (N * D) + n[None, :, None] * D + d[None, None, :]
    tl.store(dst, new.to(dt), mask=ok[:, None, :])


def hc_pre(
    h: torch.Tensor,  # [T, N, D] contiguous
    fn: torch.Tensor,  # [M, N*D] float32 contiguous: M = (2+N)*N (a hyper-connection) or N (the head)
    base: torch.Tensor,  # [M] float32
    scale: torch.Tensor,  # [3] float32 (the head: [1])
    iters: int,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor | None = None,  # [D] float32
    out_eps: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """post [T, N], comb [T, N, N] (float32; None for the head) and the block input [T, D] in
    h's dtype, as `ref_glue.hc_pre_ref`."""
    T, N, D = h.shape
    M, K = fn.shape
    head = M == N
    if N & (N - 1) or K != N * D or M not in (N, (2 + N) * N) or not h.is_contiguous() or not fn.is_contiguous():
        raise ValueError(f"hc_pre: h {tuple(h.shape)} (contiguous, N a power of two) and fn {tuple(fn.shape)}")
    MP = max(16, next_pow2(M))
    tblocks = cdiv(max(T, 1), BLOCK_T)
    splits = max(1, min(cdiv(K, BLOCK_K), PROGRAMS // tblocks))
    k_split = cdiv(cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = cdiv(K, k_split)
    dots = h.new_empty(splits, T, MP, dtype=torch.float32)
    sq = h.new_empty(splits, T, dtype=torch.float32)
    post = None if head else h.new_empty(T, N, dtype=torch.float32)
    comb = None if head else h.new_empty(T, N, N, dtype=torch.float32)
    x = h.new_empty(T, D)
    if T == 0:
        return post, comb, x
    norm = norm_weight is not None
    outs = (norm_weight if norm else base, post if post is not None else sq, comb if comb is not None else sq, x)
    bd = next_pow2(D)
    warps = min(16, max(4, N * bd // (32 * PRE_VALUES)))
    pre = dict(N=N, D=D, MP=MP, SP=next_pow2(splits), ITERS=max(iters, 1), BLOCK_D=bd, HEAD=head, NORM=norm)
    fused = T <= FUSE_T
    cnt = arrival_counters(h.device, tblocks, "hc_pre") if fused else sq
    _hc_project[(tblocks, splits)](
        h, fn, dots, sq, cnt, base, scale, *outs, T, norm_eps, hc_eps, out_eps, K=K, K_SPLIT=k_split, M=M,
        BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, FUSED=FUSE_T if fused else 0, **pre, num_warps=warps if fused else 4,
    )  # fmt: skip
    if not fused:
        grid = (T, 1 if head else 2)
        _hc_pre[grid](h, dots, sq, base, scale, *outs, T, splits, norm_eps, hc_eps, out_eps, **pre, num_warps=warps)
    return post, comb, x


def hc_post(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out2: torch.Tensor | None = None
) -> torch.Tensor:
    """h [T, N, D], out [T, D] (h's dtype), post [T, N], comb [T, N, N] float32, all contiguous ->
    the new streams [T, N, D], as `ref_glue.hc_post_ref`; out2 (like out): the block's output is
    out + out2 (added in the kernel)."""
    T, N, D = h.shape
    out2 = out2.contiguous() if out2 is not None else None  # a no-op for the experts' outputs
    for o in (out, out2 if out2 is not None else out):
        if o.shape != (T, D) or o.dtype != h.dtype or not (h.is_contiguous() and o.is_contiguous()):
            raise ValueError(
                f"hc_post: h {tuple(h.shape)} {h.dtype}, out {tuple(o.shape)} {o.dtype}: want contiguous [T, D], h's dtype"
            )
    new = torch.empty_like(h)
    if T:
        bd = min(BLOCK_D // N, next_pow2(D))
        grid = (cdiv(T, POST_T), cdiv(D, bd))
        two = out2 if out2 is not None else out
        _hc_post[grid](
            h, out, two, post.contiguous(), comb.contiguous(), new, T, N=N, D=D, BLOCK_T=POST_T, BLOCK_D=bd,
            TWO=out2 is not None,
        )  # fmt: skip
    return new
