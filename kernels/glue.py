"""DeepSeek-V4's small per-layer ops, one kernel each, rounded where PyTorch rounds (as
kernels/ref_glue.py computes them; 4-12 launches of PyTorch each otherwise):

  - `rms_norm_rope`: RMSNorm of each row (V4RMSNorm with its float32 weight, or the unweighted
    `layers.rms_norm`) and/or the interleaved rope of its trailing R dims, one program a row;
  - `route`: the router after its GEMM: scores (sqrt-softplus or sigmoid), the top-k of scores +
    bias (ties: the lowest expert id) or the hash table's row, the chosen scores normalized and
    scaled, BLOCK_T tokens a program;
  - `swiglu`: the shared expert's clamped SwiGLU (gate and up may be the row-strided halves of one
    GEMM's output); `swiglu_clamped`, its arithmetic, is also the FP8 GEMV's SwiGLU epilogue.

Legend: T tokens (rows), D features, R rope dims (trailing), E experts, k experts a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv, next_pow2

ROUTE_T = 4  # tokens a router program
SWIGLU_BLOCK = 1024


@triton.jit
def round_to(x, dt: tl.constexpr):
    """float32 x rounded to dt's precision (to nearest, ties to even) and kept float32: the rounding
    PyTorch does between ops. bf16 by integer arithmetic, which the interpreter (its casts truncate)
    and the GPU compute alike."""
    y = x
    if dt == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    if dt == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rms_norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, store_ptr, slots_ptr, stride_t, stride_x, heads,
                   rows_per_token, eps,
                   D: tl.constexpr, PAIRS: tl.constexpr, NORM: tl.constexpr, WEIGHT: tl.constexpr,
                   ROPE_PAIRS: tl.constexpr, INVERSE: tl.constexpr, STORE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, PAIRS)
    j = tl.arange(0, 2)
    col = i[:, None] * 2 + j[None, :]  # [PAIRS, 2]: the row as interleaved pairs
    ok = col < D
    dt = out_ptr.dtype.element_ty
    x_row = x_ptr + (row // heads) * stride_t + (row % heads) * stride_x  # token, then its head
    y = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(tl.sum(y * y, axis=1), axis=0) / D + eps)
        if WEIGHT:  # V4RMSNorm: weight * (x * r) in float32, then rounded
            y = round_to(tl.load(w_ptr + col, mask=ok, other=0.0) * (y * r), dt)
        else:  # layers.rms_norm: the scale rounded first, the product rounded
            y = round_to(y * round_to(r, dt), dt)
    if ROPE_PAIRS > 0:
        p = i - (D // 2 - ROPE_PAIRS)  # the pair's index in cos / sin (< 0: not roped)
        roped = (p >= 0) & (i < D // 2)
        token = row // rows_per_token
        c = tl.load(cos_ptr + token * ROPE_PAIRS + p, mask=roped, other=1.0)
        s = tl.load(sin_ptr + token * ROPE_PAIRS + p, mask=roped, other=0.0)
        if INVERSE:  # the rotation by -angle (exact: a negation)
            s = -s
        y0 = tl.sum(tl.where(j[None, :] == 0, y, 0.0), axis=1)
        y1 = tl.sum(tl.where(j[None, :] == 1, y, 0.0), axis=1)
        o0 = tl.where(roped, y0 * c - y1 * s, y0)
        o1 = tl.where(roped, y1 * c + y0 * s, y1)
        y = tl.where(j[None, :] == 0, o0[:, None], o1[:, None])
    y = round_to(y, dt).to(dt)
    tl.store(out_ptr + row * D + col, y, mask=ok)
    if STORE:  # the row also into its pool record
        tl.store(store_ptr + tl.load(slots_ptr + row) * D + col, y, mask=ok)


def rms_norm_rope(
    x: torch.Tensor,  # [T, ..., D], last dim contiguous, D even
    weight: torch.Tensor | None,  # [D] float32 (V4RMSNorm) or None (layers.rms_norm)
    eps: float,
    norm: bool = True,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T, R/2] float32
    inverse: bool = False,  # rotate by -angle (the sin negated)
    store: tuple[torch.Tensor, torch.Tensor] | None = None,  # region [N, D] contiguous, x's dtype; rows [T] int64
) -> torch.Tensor:
    """A new tensor like x: each row RMSNorm'd (when `norm`), then its last R dims roped (when
    `rope`), as ref_glue.rms_norm_ref / rope_tail_ref one after the other; with `store`, row t
    also written to region[rows[t]] (as region.index_copy_(0, rows, out) after it; x [T, D]).
    x's token and head strides are its own (the heads of one joined GEMM's output slice: no copy)."""
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0 and D % 2 == 0:
        return out
    rows = x.reshape(x.shape[0], -1, D) if x.dim() > 1 else x.reshape(-1, 1, D)  # [T, heads, D]: views
    if D % 2 or rows.stride(-1) != 1 or (rope is not None and 2 * rope[0].shape[-1] > D):
        raise ValueError(f"rms_norm_rope: x {tuple(x.shape)} (stride {x.stride()}): want an even, contiguous last dim")
    if store is not None and (
        x.dim() != 2 or store[0].dtype != x.dtype or store[0].shape[-1] != D or not store[0].is_contiguous()
    ):
        raise ValueError("rms_norm_rope: store into a contiguous [N, D] region of x's dtype, from x [T, D]")
    n = rows.shape[0] * rows.shape[1]
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (rows, rows)
    per = n // rope[0].shape[0] if rope is not None and rope[0].shape[0] else 1
    w = weight if weight is not None else rows
    region, slots = store if store is not None else (out, out)
    _rms_norm_rope[(n,)](
        rows, w, cos, sin, out, region, slots, rows.stride(0), rows.stride(1), rows.shape[1], per, eps, D=D,
        PAIRS=next_pow2(D // 2), NORM=norm, WEIGHT=weight is not None, ROPE_PAIRS=rope[0].shape[-1] if rope is not None else 0, INVERSE=inverse,
        STORE=store is not None,
    )  # fmt: skip
    return out


@triton.jit
def _route_topk(logits_ptr, bias_ptr, table_ptr, ids_in_ptr, w_ptr, ids_ptr, T, scaling, s_logit, E: tl.constexpr,
           EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
           SQRT_SOFTPLUS: tl.constexpr, HASH: tl.constexpr):  # fmt: skip
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    e = tl.arange(0, EP)
    kk = tl.arange(0, KP)
    t_ok = t < T
    dt = w_ptr.dtype.element_ty
    logit = tl.load(logits_ptr + t[:, None] * s_logit + e[None, :], mask=t_ok[:, None] & (e < E)[None, :], other=0.0)
    logit = logit.to(tl.float32)
    if SQRT_SOFTPLUS:  # softplus = log1p(exp(x)) (x itself above 20), rounded; then its sqrt, rounded
        y = tl.exp(logit)
        u = 1.0 + y
        soft = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))  # log1p, accurate for small y
        soft = round_to(tl.where(logit > 20.0, logit, soft), dt)
        score = round_to(tl.sqrt(soft), dt)
    else:
        score = round_to(tl.sigmoid(logit), dt)
    if HASH:
        tok = tl.load(ids_in_ptr + t, mask=t_ok, other=0)
    else:
        bias = tl.load(bias_ptr + e, mask=e < E, other=0.0)
        sel = tl.where((e < E)[None, :], score + bias[None, :], float("-inf"))
    weights = tl.zeros((BLOCK_T, KP), tl.float32)
    ids = tl.zeros((BLOCK_T, KP), tl.int64)
    for j in tl.static_range(K):
        if HASH:
            pick = tl.load(table_ptr + tok * K + j, mask=t_ok, other=0)
        else:
            best = tl.max(sel, axis=1)
            pick = tl.min(tl.where(sel == best[:, None], e[None, :], EP), axis=1)  # ties: the lowest id
            sel = tl.where(e[None, :] == pick[:, None], float("-inf"), sel)
        wj = tl.sum(tl.where(e[None, :] == pick[:, None], score, 0.0), axis=1)
        weights = tl.where(kk[None, :] == j, wj[:, None], weights)
        ids = tl.where(kk[None, :] == j, pick.to(tl.int64)[:, None], ids)
    total = round_to(tl.sum(weights, axis=1), dt)
    total = round_to(total + 1e-20, dt)
    weights = round_to(weights / total[:, None], dt)
    out = t[:, None] * K + kk[None, :]
    ok = t_ok[:, None] & (kk < K)[None, :]
    tl.store(w_ptr + out, round_to(weights * scaling, dt).to(dt), mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)


def route(
    logits: torch.Tensor,  # [T, E] the model dtype, rows may be strided (a joined GEMM's)
    top_k: int,
    scoring: str,
    scaling: float,
    bias: torch.Tensor | None = None,  # [E] float32
    table: torch.Tensor | None = None,  # [vocab, k] int64
    input_ids: torch.Tensor | None = None,  # [T] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [T, k] (logits' dtype), ids [T, k] int64, as ref_glue.route_ref (ids in the order
    chosen: by descending score + bias; a hash row's order)."""
    T, E = logits.shape
    if scoring not in ("sqrtsoftplus", "sigmoid") or (table is None) == (bias is None) or top_k > E:
        raise ValueError(f"route: scoring {scoring!r}, top_k {top_k} of {E}, and either a bias or a hash table")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = logits.new_empty(T, top_k)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        hashed = table is not None
        _route_topk[(cdiv(T, ROUTE_T),)](
            logits, bias if not hashed else logits, table if hashed else ids,
            input_ids if hashed else ids, weights, ids, T, scaling, logits.stride(0), E=E, EP=next_pow2(E), K=top_k,
            KP=next_pow2(top_k), BLOCK_T=ROUTE_T, SQRT_SOFTPLUS=scoring == "sqrtsoftplus", HASH=hashed,
        )  # fmt: skip
    return weights, ids


@triton.jit
def swiglu_clamped(gate, up, limit, dt: tl.constexpr):
    """silu(min(gate, limit)) * clamp(up, +-limit) of float32 values that hold dt's (the
    projections' rounded outputs), rounded where PyTorch rounds; float32 (the GEMV's epilogue too)."""
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    silu = round_to(g * tl.sigmoid(g), dt)
    return round_to(silu * u, dt)


@triton.jit
def _swiglu_clamped(gate_ptr, up_ptr, out_ptr, n, limit, s_gate, s_up, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * s_gate + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * s_up + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + i, swiglu_clamped(g, u, limit, dt).to(dt), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [..., I] (same shape and dtype; rows may be strided, as the two halves of one
    [gate | up] GEMM's output are) -> silu(min(gate, limit)) * clamp(up, +-limit), contiguous."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype}")
    I = gate.shape[-1]  # noqa: E741
    g2, u2 = (t.reshape(-1, I) if I else t.reshape(0, 0) for t in (gate, up))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        grid = (g2.shape[0], cdiv(I, SWIGLU_BLOCK))
        _swiglu_clamped[grid](g2, u2, out, I, limit, g2.stride(0), u2.stride(0), BLOCK=SWIGLU_BLOCK)
    return out
