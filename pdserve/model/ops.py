"""One switch between the Triton kernels (CUDA) and their PyTorch references (everywhere else).

Model code calls only these functions; which implementation runs is decided by the device of
the inputs, unless `set_backend("torch"|"triton")` forces one (tests, benchmarks).
"""

from __future__ import annotations

import torch

from pdserve.model.ops_kv import (  # noqa: F401  (re-exported: callers use ops.<name>)
    fp8_record_bytes,
    fp8_v4_record_bytes,
    gather_kv_fp8_v4,
    pack_kv_fp8,
    pack_kv_fp8_v4,
    store_kv_fp8_v4,
    unpack_kv_fp8,
)
from pdserve_kernels import ref

_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force "torch" or "triton" for every call; None restores per-device choice."""
    global _forced
    if name not in (None, "torch", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'torch' or 'triton'")
    _forced = name


def _use_triton(t: torch.Tensor) -> bool:
    if _forced is not None:
        return _forced == "triton"
    return t.is_cuda


def uses_triton(t: torch.Tensor) -> bool:
    """Whether calls on t take the Triton kernels (for a fused path whose torch side is the model's own code)."""
    return _use_triton(t)


def sparse_mla_decode(q, kv, indices, sm_scale: float, d_v: int, sink=None, extra=None):
    """kv: [N, D] values, or [N, R] uint8 FP8 records (kernels/kv_fp8.py). extra: (kv2,
    indices2 [B, S, K2]), a second key source in kv's format read in the same softmax."""
    x_kv, x_idx = extra if extra is not None else (None, None)
    if _use_triton(q):
        if kv.dtype == torch.uint8:
            from pdserve_kernels import sparse_mla_decode_fp8 as fp8_kernel

            out, lse = fp8_kernel(_half(q), kv, indices, sm_scale, d_v, sink=sink, extra_kv=x_kv, extra_indices=x_idx)
            return out.to(q.dtype), lse
        from pdserve_kernels import sparse_mla_decode as kernel

        return kernel(q, kv, indices, sm_scale, d_v, sink=sink, extra_kv=x_kv, extra_indices=x_idx)
    if kv.dtype == torch.uint8:  # dequantize only the rows the queries read
        rows, local = _fp8_rows(kv, indices, d_v, q)
        if extra is not None:
            x_kv, x_idx = _fp8_rows(x_kv, x_idx, d_v, q)
        return ref.sparse_mla_decode_ref(q, rows, local, sm_scale, d_v, sink=sink, extra_kv=x_kv, extra_indices=x_idx)
    return ref.sparse_mla_decode_ref(q, kv, indices, sm_scale, d_v, sink=sink, extra_kv=x_kv, extra_indices=x_idx)


def _fp8_rows(kv: torch.Tensor, indices: torch.Tensor, d_v: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 records `indices` name, dequantized [K', D], and indices into them."""
    return _read_rows(indices, lambda flat: unpack_kv_fp8(kv[flat], d_v, q.shape[3]).to(q.dtype))


def _read_rows(indices: torch.Tensor, read) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference paths over byte records: `read(flat slot ids)` dequantizes only the rows the
    queries name; returns them and indices [same shape] into them (-1 kept)."""
    flat = indices.clamp(min=0).long().flatten()
    local = torch.where(indices >= 0, torch.arange(flat.numel(), device=flat.device).view_as(indices), -1).to(
        torch.int32
    )
    return read(flat), local


def _half(q: torch.Tensor) -> torch.Tensor:
    """The FP8-record kernels take bf16/fp16 queries (they round the dequantized values to q's
    dtype): an fp32 model's queries go in as bf16."""
    return q.to(torch.bfloat16) if q.dtype == torch.float32 else q


def copy_blocks(src, dst, src_ids, dst_ids) -> None:
    """dst[:, dst_ids] = src[:, src_ids] over [L, N, W] block words (a same-host KV transfer; its
    posts on a GPU go through pdserve_kernels.block_copy.BoundCopy: disagg/cuda_ipc.py)."""
    if _use_triton(dst):
        from pdserve_kernels import copy_blocks as kernel

        return kernel(src, dst, src_ids, dst_ids)
    return ref.copy_blocks_ref(src, dst, src_ids, dst_ids)


def fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit: float | None = None):
    """swiglu_limit: DeepSeek-V4's clamped SwiGLU (None: plain SwiGLU)."""
    if _use_triton(x):
        from pdserve_kernels.fused_moe import (
            fused_moe as kernel,  # the submodule of the same name shadows the lazy export
        )

        return kernel(x, w13, w2, topk_weights, topk_ids, swiglu_limit=swiglu_limit)
    return ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids, swiglu_limit=swiglu_limit)


def hc_mix(mixes, base, scale, n: int, iters: int, eps: float):
    """DeepSeek-V4's hyper-connection gates and Sinkhorn-normalized stream mix: pre [T, N], post [T, N],
    comb [T, N, N] (float32) from mixes [T, (2+N)*N]."""
    if _use_triton(mixes):
        from pdserve_kernels.hyper import hc_mix as kernel

        return kernel(mixes, base, scale, n, iters, eps)
    return ref.hc_mix_ref(mixes, base, scale, n, iters, eps)


def fp8_linear(x, weight, weight_scale_inv, block: tuple[int, int], bias=None):
    """x [..., K] @ (e4m3 weight [N, K] x its block scales)^T (+ bias) -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if _use_triton(x):
        from pdserve_kernels.fp8_gemm import fp8_linear as kernel

        y = kernel(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, weight_scale_inv, block, bias)
    else:  # the reference without activation quantization: float32 equals dequantizing at load
        from pdserve_kernels.ref_fp8 import fp8_linear_ref

        y = fp8_linear_ref(x2, weight, weight_scale_inv, block, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x, weight, weight_scale_inv=None, block: tuple[int, int] | None = None):
    """x [T, G, K] -> [T, G * R]: output rows g*R .. g*R+R-1 of weight [G * R, K] read x[:, g]
    (V4's o_a projection), every group in one launch. weight in x's dtype (one strided-batched
    matmul), or e4m3 with its block scales (kernels/fp8_gemm.py's fp8_grouped_linear on CUDA)."""
    if weight_scale_inv is None:
        from pdserve_kernels.ref_fp8 import grouped_mm

        return grouped_mm(x, weight)
    if _use_triton(x):
        from pdserve_kernels.fp8_gemm import fp8_grouped_linear as kernel

        return kernel(x if x.stride(-1) == 1 else x.contiguous(), weight, weight_scale_inv, block)
    from pdserve_kernels.ref_fp8 import grouped_linear_ref  # no activation quantization, as fp8_linear's

    return grouped_linear_ref(x, weight, weight_scale_inv, block)


def quant_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (e4m3 values, float32 scale_inv per block): DeepSeek's quantizer (the
    same on every device; dummy weights)."""
    from pdserve_kernels.ref_fp8 import quant_block_fp8 as quant

    return quant(w, block)


def fused_moe_fp8(x, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block: tuple[int, int]):
    """Experts in e4m3 with block scales (kernels/fused_moe_fp8.py; activations quantized per 128
    values unless x is float32)."""
    if _use_triton(x):
        from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8 as kernel

        return kernel(x, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block_shape=block)
    return ref.fused_moe_ref(
        x, w13, w2, topk_weights, topk_ids, w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv, block_shape=block
    )


def fp4_moe_mxfp8(backend: str, x: torch.Tensor) -> bool:
    """Whether FP4 experts run with MXFP8 activations (`fused_moe_fp4(mxfp8=True)`) for this
    backend choice (engine/config.py's fp4_moe_backend) on x's device; "auto" follows the
    per-GPU table kernels/configs.py FP4_MOE_BACKEND."""
    if backend != "auto":
        return backend == "mxfp8"
    from pdserve_kernels import configs
    from pdserve_kernels._launch import capability

    return configs.fp4_moe_backend(capability(x.device) if _use_triton(x) else configs.CPU) == "mxfp8"


def fused_moe_fp4(
    x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, swiglu_limit: float | None = None, mxfp8: bool = False
):
    """Packed e2m1 expert weights with ue8m0 scales per 32 values (kernels/ref_fp4.py's layout).
    mxfp8: activations quantized to MXFP8 (kernels/fused_moe_fp4_mx8.py; checkpoint layout only)."""
    if _use_triton(x):
        if mxfp8:
            from pdserve_kernels.fused_moe_fp4_mx8 import fused_moe_fp4_mx8 as mx8_kernel

            return mx8_kernel(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, swiglu_limit=swiglu_limit)
        from pdserve_kernels.fused_moe_fp4 import fused_moe_fp4 as kernel

        return kernel(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, swiglu_limit=swiglu_limit)
    from pdserve_kernels.ref_fp4 import fused_moe_fp4_ref

    return fused_moe_fp4_ref(
        x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, swiglu_limit=swiglu_limit, mxfp8_act=mxfp8
    )


def indexer_topk(q, k_cache, weights, candidates, topk: int):
    if _use_triton(q):
        from pdserve_kernels import indexer_topk as kernel

        return kernel(q, k_cache, weights, candidates, topk)
    return ref.indexer_topk_ref(q, k_cache, weights, candidates, topk)


def mla_prefill_attention(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, sm_scale: float,
                          max_seqlen_k: int | None = None):  # fmt: skip
    if _use_triton(q):
        from pdserve_kernels import mla_prefill_attention as kernel

        return kernel(
            q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale, max_seqlen_k=max_seqlen_k
        )
    return ref.mla_prefill_attention_ref(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale)


def paged_mla_decode(
    q, kv, block_tables, seq_ids, context_lens, page: int, max_len: int, sm_scale: float, d_v: int, sink=None
):
    """kv: [N, D] values, or [N, R] uint8 FP8 records (kernels/kv_fp8.py)."""
    if _use_triton(q):
        from pdserve_kernels import paged_mla_decode as kernel

        if kv.dtype == torch.uint8:
            out, lse = kernel(
                _half(q), kv, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink=sink
            )
            return out.to(q.dtype), lse
        return kernel(q, kv, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink=sink)
    idx = ref.paged_slots(block_tables, seq_ids, context_lens, page, max_len)  # [T, C]: the reference expands
    return sparse_mla_decode(q, kv, idx[:, None], sm_scale, d_v, sink=sink)


def sparse_mla_decode_fp8_v4(q, pages, indices, sm_scale: float, rope: int, sink=None):
    """DeepSeek-V4 decode over fp8_ds_v4 pages [Nb, P, R] uint8 (kernels/kv_fp8.py): a KVCache
    region's `layer_pages`, or a step buffer filled by `store_kv_fp8_v4` (or `kv_fp8.copy_kv_fp8_v4`);
    an even P keeps pages 16-byte aligned, which the kernel's reads want. indices [B, S, K]
    int32 slot ids (page * P + record), -1 = padding. Returns out [B, S, H, D] (K = V, rope dims
    included) and lse [B, S, H]."""
    if _use_triton(q):
        from pdserve_kernels import sparse_mla_decode_fp8_v4 as kernel

        out, lse = kernel(_half(q), pages, indices, sm_scale, rope, sink=sink)
        return out.to(q.dtype), lse
    from pdserve_kernels import kv_fp8

    rec = kv_fp8.V4Record(q.shape[3], rope)
    rows, local = _read_rows(
        indices, lambda flat: kv_fp8.unpack_kv_fp8_v4(kv_fp8.gather_kv_fp8_v4(pages, flat, rec), rec).to(q.dtype)
    )
    return ref.sparse_mla_decode_ref(q, rows, local, sm_scale, q.shape[3], sink=sink)


def indexer_topk_paged(
    q, k_cache, weights, block_tables, seq_ids, context_lens, page: int, max_len: int, topk: int, weight_scale=1.0
):
    """weights [T, H] are read as weights.float() * weight_scale (in the kernel on a GPU)."""
    paged = (block_tables, seq_ids, context_lens, page, max_len, topk)
    if _use_triton(q):
        from pdserve_kernels import indexer_topk_paged as kernel

        return kernel(q, k_cache, weights, *paged, weight_scale=weight_scale)
    weights = weights if weight_scale == 1.0 else weights.float() * weight_scale
    return ref.indexer_topk_paged_ref(q, k_cache, weights, *paged)


# DeepSeek-V4's per-layer glue (kernels/mhc.py, kernels/glue.py; references: kernels/ref_glue.py)


def rms_norm(x, weight, eps: float, rope=None, store=None):
    """x [T, ..., D] -> RMSNorm over D (weight [D] float32: V4RMSNorm; None: the unweighted
    norm with its scale rounded to x's dtype), then the interleaved rope of the last R dims when
    rope = (cos, sin) [T, R/2] float32 is given; store = (region [N, D] of x's dtype, rows [T]):
    the result also into those rows. One kernel on a GPU (an even D)."""
    if _use_triton(x) and x.shape[-1] % 2 == 0:
        from pdserve_kernels.glue import rms_norm_rope

        return rms_norm_rope(x, weight, eps, rope=rope, store=store)
    from pdserve_kernels.ref_glue import rms_norm_ref, rope_tail_ref

    out = rms_norm_ref(x, weight, eps)
    out = out if rope is None else rope_tail_ref(out, *rope)
    if store is not None:
        store[0].index_copy_(0, store[1], out)
    return out


def rope_tail(x, cos, sin, inverse: bool = False):
    """x [T, ..., D], its last R dims rotated as interleaved pairs (by -angle: inverse); cos/sin [T, R/2] fp32."""
    if _use_triton(x) and x.shape[-1] % 2 == 0:
        from pdserve_kernels.glue import rms_norm_rope

        return rms_norm_rope(x, None, 0.0, norm=False, rope=(cos, sin), inverse=inverse)
    from pdserve_kernels.ref_glue import rope_tail_ref

    return rope_tail_ref(x, cos, -sin if inverse else sin)


def hc_pre(h, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, norm_weight=None, out_eps: float = 0.0):
    """A hyper-connection before its block: post [T, N], comb [T, N, N] and the block's input
    [T, D] (RMSNorm'd by norm_weight when given); the head (fn [N, N*D]): (None, None, input)."""
    if _use_triton(h):
        from pdserve_kernels.mhc import hc_pre as kernel

        return kernel(h, fn, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps)
    from pdserve_kernels.ref_glue import hc_pre_ref

    return hc_pre_ref(h, fn, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps)


def hc_post(h, out, post, comb, out2=None):
    """The new streams [T, N, D]: post * out + comb^T @ h (out: out + out2 when out2 is given)."""
    if _use_triton(h):
        from pdserve_kernels.mhc import hc_post as kernel

        return kernel(h, out, post, comb, out2)
    from pdserve_kernels.ref_glue import hc_post_ref

    return hc_post_ref(h, out if out2 is None else out + out2, post, comb)


def route(logits, top_k: int, scoring: str, scaling: float, bias=None, table=None, input_ids=None):
    """The router after its GEMM: weights [T, k], expert ids [T, k] (top-k of scores + bias, or
    the hash table's rows of input_ids)."""
    if _use_triton(logits):
        from pdserve_kernels.glue import route as kernel

        return kernel(logits, top_k, scoring, scaling, bias, table, input_ids)
    from pdserve_kernels.ref_glue import route_ref

    return route_ref(logits, top_k, scoring, scaling, bias, table, input_ids)


def swiglu(gate, up, limit: float):
    """DeepSeek-V4's clamped SwiGLU."""
    if _use_triton(gate):
        from pdserve_kernels.glue import swiglu as kernel

        return kernel(gate, up, limit)
    from pdserve_kernels.ref_glue import swiglu_ref

    return swiglu_ref(gate, up, limit)


def compress_decode(kv, gate, states, slots, positions, position_bias, dim: int, overlap: bool):
    """A V4 compressor's decode step in one kernel (kernels/compress.py): the entries [B, Dc] before
    kv_norm and rope, the state records advanced in place. Triton only: its torch side is
    `CompressedKV.update`'s general path (callers check `uses_triton`)."""
    from pdserve_kernels.compress import compress_decode as kernel

    return kernel(kv, gate, states, slots, positions, position_bias, dim, overlap)


def compress_chunk(kv, gate, states, slots, dst, plan, position_bias, dim: int, overlap: bool):
    """A V4 compressor's update over any step's plan (`step.GroupPlan`) in two kernels
    (kernels/compress.py): the entries [U, Dc] before kv_norm and rope; the new records at dst.
    Triton only, as `compress_decode`."""
    from pdserve_kernels.compress import compress_chunk as kernel

    fields = (plan.seq, plan.src, plan.present, plan.first, plan.prev, plan.has_prev, plan.last, plan.pending)
    return kernel(kv, gate, states, slots, dst, fields, position_bias, dim, overlap)


def fp8_swiglu(x, gate, up, limit: float, block: tuple[int, int], joined=None):
    """swiglu(x @ gate^T, x @ up^T, limit) [..., I], gate / up = (e4m3 weight [I, K], its block
    scales): at decode rows one kernel on a GPU (kernels/fp8_gemm.py's fp8_swiglu: the FP8 GEMV
    with the SwiGLU in its epilogue); else one FP8 linear over `joined` (both weights as rows of
    one, with their scales) or two, and the SwiGLU."""
    x2 = x.reshape(-1, x.shape[-1])
    if _use_triton(x):
        from pdserve_kernels.fp8_gemm import fp8_swiglu as kernel

        y = kernel(x2 if x2.stride(-1) == 1 else x2.contiguous(), gate, up, limit, block, joined=joined)
    else:
        from pdserve_kernels.ref_fp8 import fp8_linear_ref

        y = swiglu(fp8_linear_ref(x2, *gate, block), fp8_linear_ref(x2, *up, block), limit)
    return y.view(*x.shape[:-1], gate[0].shape[0])
