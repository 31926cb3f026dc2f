"""DeepSeek-V4's per-layer glue (kernels/mhc.py, kernels/glue.py, the shared expert's FP8 GEMV;
references: kernels/ref_glue.py), chosen as ops.py chooses: the Triton kernels on CUDA (or when
`ops.set_backend` forces them), the PyTorch references elsewhere. ops.py re-exports every
function here: model code calls them as `ops.<name>`.
"""

from __future__ import annotations


def _triton(t) -> bool:
    from pdserve.model.ops import uses_triton  # ops imports this module: resolved at call time

    return uses_triton(t)


def rms_norm(x, weight, eps: float, rope=None, store=None):
    """x [T, ..., D] -> RMSNorm over D (weight [D] float32: V4RMSNorm; None: the unweighted
    norm with its scale rounded to x's dtype), then the interleaved rope of the last R dims when
    rope = (cos, sin) [T, R/2] float32 is given; store = (region [N, D] of x's dtype, rows [T]):
    the result also into those rows. One kernel on a GPU (an even D)."""
    if _triton(x) and x.shape[-1] % 2 == 0:
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
    if _triton(x) and x.shape[-1] % 2 == 0:
        from pdserve_kernels.glue import rms_norm_rope

        return rms_norm_rope(x, None, 0.0, norm=False, rope=(cos, sin), inverse=inverse)
    from pdserve_kernels.ref_glue import rope_tail_ref

    return rope_tail_ref(x, cos, -sin if inverse else sin)


def hc_pre(h, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, norm_weight=None, out_eps: float = 0.0):
    """A hyper-connection before its block: post [T, N], comb [T, N, N] and the block's input
    [T, D] (RMSNorm'd by norm_weight when given); the head (fn [N, N*D]): (None, None, input)."""
    if _triton(h):
        from pdserve_kernels.mhc import hc_pre as kernel

        return kernel(h, fn, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps)
    from pdserve_kernels.ref_glue import hc_pre_ref

    return hc_pre_ref(h, fn, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps)


def hc_post(h, out, post, comb, out2=None):
    """The new streams [T, N, D]: post * out + comb^T @ h (out: out + out2 when out2 is given)."""
    if _triton(h):
        from pdserve_kernels.mhc import hc_post as kernel

        return kernel(h, out, post, comb, out2)
    from pdserve_kernels.ref_glue import hc_post_ref

    return hc_post_ref(h, out if out2 is None else out + out2, post, comb)


def route(logits, top_k: int, scoring: str, scaling: float, bias=None, table=None, input_ids=None):
    """The router after its GEMM: weights [T, k], expert ids [T, k] (top-k of scores + bias, or
    the hash table's rows of input_ids)."""
    if _triton(logits):
        from pdserve_kernels.glue import route as kernel

        return kernel(logits, top_k, scoring, scaling, bias, table, input_ids)
    from pdserve_kernels.ref_glue import route_ref

    return route_ref(logits, top_k, scoring, scaling, bias, table, input_ids)


def swiglu(gate, up, limit: float):
    """DeepSeek-V4's clamped SwiGLU."""
    if _triton(gate):
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


def fp8_swiglu(x, gate, up, limit: float, block: tuple[int, int], joined=None):
    """swiglu(x @ gate^T, x @ up^T, limit) [..., I], gate / up = (e4m3 weight [I, K], its block
    scales): at decode rows one kernel on a GPU (kernels/fp8_gemm.py's fp8_swiglu: the FP8 GEMV
    with the SwiGLU in its epilogue); else one FP8 linear over `joined` (both weights as rows of
    one, with their scales) or two, and the SwiGLU."""
    x2 = x.reshape(-1, x.shape[-1])
    if _triton(x):
        from pdserve_kernels.fp8_gemm import fp8_swiglu as kernel

        y = kernel(x2 if x2.stride(-1) == 1 else x2.contiguous(), gate, up, limit, block, joined=joined)
    else:
        from pdserve_kernels.ref_fp8 import fp8_linear_ref

        y = swiglu(fp8_linear_ref(x2, *gate, block), fp8_linear_ref(x2, *up, block), limit)
    return y.view(*x.shape[:-1], gate[0].shape[0])
