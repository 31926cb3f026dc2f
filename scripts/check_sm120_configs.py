"""Compile every kernel (decode, and the MLA prefill) at its sm_120 tile configs for the sm_120
target (RTX PRO 6000 Blackwell: 101,376 bytes of shared memory per block) and read back what
the compiler allocated:
Triton's shared memory (`metadata.shared`, plus any static shared memory in the cubin) and the
registers / stack from the cubin (`cuobjdump --dump-resource-usage`, shipped with Triton). No GPU
is needed: Triton compiles ahead of time for any target (`triton.compile(ASTSource, target=
GPUTarget("cuda", 120, 32))`) with its bundled ptxas.

How: each kernel wrapper (`sparse_mla_decode`, `fused_moe`, ...) is called with CPU tensors at the
model's real dims while `capability()` reports the target, so the wrapper picks the target's
config for each bucket exactly as it would on that card; `JITFunction.run` is replaced by a
recorder, so nothing launches; each recorded launch is then specialized by Triton's own binder
(pointer alignment, strides equal to 1, divisibility by 16: what a real launch would compile)
and compiled for the target.

    python scripts/check_sm120_configs.py [--arch 120 90] [--only moe_fp4 ...] [--json PATH]

Prints one row per compiled kernel and writes JSON (default docs/bench/sm120_configs.json);
exits 1 if an entry does not fit. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_LIMIT = {90: 232448, 120: 101376}  # bytes per block, opt-in maximum
SM_COUNT = {90: 132, 120: 188}  # H200; RTX PRO 6000 (the wrappers size split counts from it)
MODULES = (
    "sparse_mla",
    "mla_prefill",
    "indexer",
    "fused_moe",
    "fused_moe_fp8",
    "fused_moe_fp4",
    "fused_moe_fp4_mx8",
    "fp8_gemm",
    "fp8_gemv",
    "block_copy",
    "kv_checksum",
)
# moe_fp4_dot_scaled: the FP4 configs with `MoEConfig.dot_scaled` (not the default): compiled for
# the record (Triton 3.6 upcasts bf16 x e2m1 to bf16 mma.sync on sm_120 too: their `mma` field);
# moe_fp4_mx8: FP4 weights x MXFP8 activations, e4m3 x e4m3 dot_scaled (`mma` shows kind::mxf8f6f4)
FAMILIES = (
    "mla",
    "mla_prefill",
    "indexer",
    "moe",
    "moe_fp8",
    "moe_fp4",
    "moe_fp4_dot_scaled",
    "moe_fp4_frag",
    "moe_fp4_mx8",
    "fp8_gemm",
    "fp8_gemv",
    "hc",
    "v4_glue",
    "v4_chunk_step",
    "block_copy",
    "kv_checksum",
)


def v4_glue_cases() -> list:
    from pdserve_kernels.compress import compress_chunk, compress_decode
    from pdserve_kernels.fused_moe import sum_pairs
    from pdserve_kernels.glue import rms_norm_rope, route, swiglu
    from pdserve_kernels.mhc import hc_post, hc_pre
    from pdserve_kernels.v4_step import rate_entries, window_rope

    f32, bf = torch.float32, torch.bfloat16
    cases = []
    for T in (1, 128):
        i64, pos, seq, yarn = (
            torch.int64,
            torch.zeros(T, dtype=torch.int64),
            torch.zeros(T, dtype=torch.int32),
            (_e(32, dtype=f32), 1.0),
        )
        cases += [
            ("v4_glue", f"decode step: window + ropes T={T}", lambda T=T, p=pos, s=seq, y=yarn: window_rope(p, s, torch.zeros(T, 2048, dtype=i64), 64, 128, [y, y])),
            *[("v4_glue", f"decode step: rate {m} entries T={T}", lambda T=T, p=pos, s=seq, y=yarn, m=m: rate_entries(
                p, s, p, p, torch.zeros(T, 2048, dtype=torch.int32), 64, m, 8192 if m == 128 else 0, m == 128, y)) for m in (4, 128)],
            ("v4_glue", f"kv norm + rope + store T={T}", lambda T=T: rms_norm_rope(_e(T, 512, dtype=bf), _e(512, dtype=f32), 1e-6, rope=(_e(T, 32, dtype=f32),) * 2, store=(_e(4 * T, 512, dtype=bf), torch.zeros(T, dtype=i64)))),
            ("v4_glue", f"rope by -angle T={T}", lambda T=T: rms_norm_rope(_e(T, 64, 512, dtype=bf), None, 0.0, norm=False, rope=(_e(T, 32, dtype=f32),) * 2, inverse=True)),
            ("v4_glue", f"hc_post + MoE add T={T}", lambda T=T: hc_post(_e(T, 4, 4096, dtype=bf), _e(T, 4096, dtype=bf), _e(T, 4, dtype=f32), _e(T, 4, 4, dtype=f32), _e(T, 4096, dtype=bf))),
        ]  # fmt: skip
        h, rope = _e(T, 4, 4096, dtype=bf), (_e(T, 32, dtype=f32), _e(T, 32, dtype=f32))
        hc = (_e(24, 16384, dtype=f32), _e(24, dtype=f32), _e(3, dtype=f32), 20, 1e-6, 1e-6, _e(4096, dtype=f32))
        cases += [
            ("v4_glue", f"hc_pre T={T}", lambda h=h, hc=hc: hc_pre(h, *hc, 1e-6)),
            ("v4_glue", f"hc_post T={T}", lambda h=h, T=T: hc_post(h, _e(T, 4096, dtype=bf), _e(T, 4, dtype=f32), _e(T, 4, 4, dtype=f32))),
            ("v4_glue", f"q heads norm + rope T={T}", lambda T=T, r=rope: rms_norm_rope(_e(T, 64, 512, dtype=bf), None, 1e-6, rope=r)),
            ("v4_glue", f"router T={T}", lambda T=T: route(_e(T, 256, dtype=bf), 6, "sqrtsoftplus", 1.5, bias=_e(256, dtype=f32))),
            ("v4_glue", f"hash router T={T}", lambda T=T: route(_e(T, 256, dtype=bf), 6, "sqrtsoftplus", 1.5, table=torch.zeros(1000, 6, dtype=torch.int64), input_ids=torch.zeros(T, dtype=torch.int64))),
            ("v4_glue", f"swiglu T={T}", lambda T=T: swiglu(_e(T, 2048, dtype=bf), _e(T, 2048, dtype=bf), 10.0)),
            ("v4_glue", f"swiglu of one [gate | up] GEMM T={T}", lambda T=T: (lambda y: swiglu(y[:, :2048], y[:, 2048:], 10.0))(_e(T, 4096, dtype=bf))),
            ("v4_glue", f"MoE top-k sum (2 splits, k 6) T={T}", lambda T=T: sum_pairs(_e(2, 6 * T, 4096, dtype=f32), 6, bf)),
        ]  # fmt: skip
        for what, dim, m, overlap in (("CSA", 512, 4, True), ("indexer", 128, 4, True), ("HCA", 512, 128, False)):
            C, i64 = (2 if overlap else 1) * dim, torch.int64
            state = 2 * (m - 1) * C + (2 * m * dim if overlap else 0)
            cases.append(("v4_glue", f"{what} compressor decode B={T}", lambda T=T, dim=dim, m=m, o=overlap, C=C, s=state: compress_decode(
                _e(T, C, dtype=bf), _e(T, C, dtype=bf), _e(T + 1, s, dtype=bf), torch.zeros(T, dtype=i64), torch.zeros(T, dtype=i64), _e(m, C, dtype=f32), dim, o)))  # fmt: skip
            # a verify step's chunks (k = 2: 3 tokens a sequence, up to 2 groups each), records to spare slots
            U, z, zb = 2 * T, lambda *s: torch.zeros(*s, dtype=i64), lambda *s: torch.zeros(*s, dtype=torch.bool)
            plan = (z(U), z(U, m), zb(U, m), zb(U), z(U), zb(U), z(T), z(T))
            cases.append(("v4_glue", f"{what} compressor chunk (verify k=2) B={T}", lambda T=T, dim=dim, m=m, o=overlap, C=C, s=state, p=plan: compress_chunk(
                _e(3 * T, C, dtype=bf), _e(3 * T, C, dtype=bf), _e(2 * T + 1, s, dtype=bf), z(T), z(T), p, _e(m, C, dtype=f32), dim, o)))  # fmt: skip
    return cases


def v4_chunk_step_cases() -> list:
    """V4-Flash's metadata of a step of chunks (kernels/v4_chunk_step.py; W 128, bs 64, 64 rope
    pairs' half 32, rates 4 and 128 at a 128K context): verify steps of k = 2 at B = 1, 64 and the
    kernels' bound 256 (the prefix sums' vector), and an 8K-token prefill chunk."""
    from pdserve_kernels.v4_chunk_step import MAX_B, chunk_rate_entries, chunk_window_rope

    i64, yarn, cases = torch.int64, (_e(32, dtype=torch.float32), 1.0), []
    for B, n in ((1, 3), (64, 3), (MAX_B, 3), (1, 8192)):
        T = B * n
        pos, seq, starts, lens = (
            torch.zeros(T, dtype=i64), torch.zeros(T, dtype=torch.int32), torch.zeros(B, dtype=i64), torch.full((B,), n)
        )  # fmt: skip
        tag = f"B={B} T={T}"
        cases += [
            ("v4_chunk_step", f"chunk step: window + ropes {tag}", lambda p=pos, s=seq, n0=starts, L=lens, y=yarn:
             chunk_window_rope(p, s, n0, L, torch.zeros(n0.shape[0], 2048, dtype=i64), 64, 128, [y, y])),
            *[("v4_chunk_step", f"chunk step: rate {m} entries {tag}", lambda p=pos, s=seq, n0=starts, L=lens, y=yarn, m=m:
               chunk_rate_entries(p, s, n0, L, torch.zeros(n0.shape[0], 2048, dtype=torch.int32), 64, m,
                                  1024 if m == 128 else 0, m == 128, y)) for m in (4, 128)],
        ]  # fmt: skip
    return cases


@contextlib.contextmanager
def as_target(cc: int):
    """Wrappers see compute capability `cc` and its SM count; launches are recorded, not run."""
    launches = []
    mods = [importlib.import_module(f"pdserve_kernels.{m}") for m in MODULES]
    saved = [(m, n, getattr(m, n)) for m in mods for n in ("capability", "sm_count") if hasattr(m, n)]
    orig_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
        return None

    for m, n, _ in saved:
        setattr(m, n, (lambda dev: cc) if n == "capability" else (lambda dev: SM_COUNT[cc]))
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = orig_run
        for m, n, f in saved:
            setattr(m, n, f)


def compile_launch(fn: JITFunction, args, kwargs, cc: int):
    """What `fn[grid](*args, **kwargs)` would compile on a device of capability cc."""
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False, instrumentation_mode="")
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return {}
    return dict(zip(("regs", "stack", "static_shared", "local"), map(int, m.groups())))


def _e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def cases(families):
    """(family, label, call) with CPU tensors at DeepSeek dims; each call picks its configs."""
    from pdserve_kernels import configs, kv_fp8
    from pdserve_kernels.fused_moe import fused_moe
    from pdserve_kernels.fused_moe_fp4 import fused_moe_fp4
    from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8
    from pdserve_kernels.indexer import indexer_topk
    from pdserve_kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_fp8

    out = []
    idx = lambda B, K: torch.zeros(B, 1, K, dtype=torch.int32)  # noqa: E731
    if "mla" in families:
        rec = kv_fp8.record_bytes(512, 64)
        for B, H, size in ((1, 16, "small"), (64, 64, "large")):  # V3.2: D = 576, d_v = 512
            q = _e(B, 1, H, 576)
            out.append(
                (
                    "mla",
                    f"bf16 {size} (V3.2 B={B} H={H})",
                    lambda q=q, B=B: sparse_mla_decode(q, _e(4096, 576), idx(B, 2048), 0.1, 512),
                )
            )
            out.append(
                (
                    "mla",
                    f"fp8 {size} (V3.2 B={B} H={H})",
                    lambda q=q, B=B: sparse_mla_decode_fp8(q, _e(4096, rec, dtype=torch.uint8), idx(B, 2048), 0.1, 512),
                )
            )
        from pdserve_kernels.sparse_mla import paged_mla_decode

        def paged(B, H, kv, page=64, ctx=4096):  # dense MLA decode over the block table (V3: D = 576)
            tables = torch.zeros(B, ctx // page, dtype=torch.int32)
            ids, lens = torch.zeros(B, dtype=torch.int32), torch.full((B,), ctx, dtype=torch.int32)
            paged_mla_decode(_e(B, 1, H, 576), kv, tables, ids, lens, page, ctx, 0.1, 512)

        for B, H in ((1, 16), (64, 64)):
            out.append(("mla", f"paged bf16 (V3 B={B} H={H})", lambda B=B, H=H: paged(B, H, _e(4096, 576))))
            out.append(
                ("mla", f"paged fp8 (V3 B={B} H={H})", lambda B=B, H=H: paged(B, H, _e(4096, rec, dtype=torch.uint8)))
            )
        # V4-Flash: D = d_v = 512, sinks; K = window 128 + top-512 CSA entries (HCA reads more
        # rows with the same tiles); all 64 heads, 16 per TP4 rank in a decode batch, float32 parity
        sink = lambda H: _e(H, dtype=torch.float32)  # noqa: E731
        for B, H, dt in ((1, 64, torch.bfloat16), (64, 16, torch.bfloat16), (1, 64, torch.float32)):
            name = "fp32" if dt == torch.float32 else "bf16"
            out.append(
                (
                    "mla",
                    f"{name} (V4-Flash B={B} H={H}, sinks)",
                    lambda B=B, H=H, dt=dt: sparse_mla_decode(
                        _e(B, 1, H, 512, dtype=dt), _e(4096, 512, dtype=dt), idx(B, 640), 0.1, 512, sink=sink(H)
                    ),
                )
            )
        # V4-Flash with --kv-cache-dtype fp8: fp8_ds_v4 pages of 64 records (the pool) or of 1
        # (gathered records), 584 bytes a record
        from pdserve_kernels.sparse_mla import sparse_mla_decode_fp8_v4

        for B, H, P in ((1, 64, 64), (64, 64, 64), (64, 16, 1)):
            out.append(
                (
                    "mla",
                    f"fp8_v4 (V4-Flash B={B} H={H} P={P}, sinks)",
                    lambda B=B, H=H, P=P: sparse_mla_decode_fp8_v4(
                        _e(B, 1, H, 512), _e(4096 // P, P, 584, dtype=torch.uint8), idx(B, 640), 0.1, sink=sink(H)
                    ),
                )
            )
    if "mla_prefill" in families:  # V3 / V3.2 dims: qk 192 = 128 + 64, v 128, 128 heads
        from pdserve_kernels.mla_prefill import mla_prefill_attention

        def prefill(T=512):
            kv, cu = _e(T, 128, 256), torch.tensor([0, T], dtype=torch.int32)
            mla_prefill_attention(_e(T, 128, 192), kv[..., :128], _e(T, 64), kv[..., 128:], cu, cu, T, 0.1)

        out.append(("mla_prefill", "bf16 (V3 H=128, 512 tokens)", prefill))
    if "indexer" in families:
        out.append(
            (
                "indexer",
                "V3.2 / V4-Flash H=64 D=128",
                lambda: indexer_topk(
                    _e(4, 64, 128),
                    _e(4096, 128),
                    _e(4, 64, dtype=torch.float32),
                    torch.zeros(4, 2048, dtype=torch.int32),
                    512,
                ),
            )
        )
        from pdserve_kernels.indexer import indexer_topk_paged

        out.append(
            (
                "indexer",
                "paged V3.2 H=64 D=128",
                lambda: indexer_topk_paged(
                    _e(4, 64, 128),
                    _e(4096, 128),
                    _e(4, 64, dtype=torch.float32),
                    torch.zeros(4, 32, dtype=torch.int32),
                    torch.zeros(4, dtype=torch.int32),
                    torch.full((4,), 2048, dtype=torch.int32),
                    64,
                    2048,
                    512,
                ),
            )
        )
        out.append(  # V4-Flash's CSA at 128K: 32,768 entries, the selection's looped path
            (
                "indexer",
                "paged V4-Flash 32K entries",
                lambda: indexer_topk_paged(
                    _e(1, 64, 128),
                    _e(4096, 128),
                    _e(1, 64, dtype=torch.float32),
                    torch.zeros(1, 512, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32),
                    torch.full((1,), 32768, dtype=torch.int32),
                    64,
                    32768,
                    512,
                ),
            )
        )
    if "fp8_gemm" in families:  # V3.2's o_proj (N 7168, K 16384) at every M bucket, bf16 and fp32 x
        from pdserve_kernels import fp8_gemm
        from pdserve_kernels.fp8_gemm import fp8_linear

        f8, n, kk = torch.float8_e4m3fn, 7168, 16384
        for M, dt in (
            (1, torch.bfloat16),
            (64, torch.bfloat16),
            (256, torch.bfloat16),
            (2048, torch.bfloat16),
            (1, torch.float32),
        ):
            out.append(
                (
                    "fp8_gemm",
                    f"{str(dt)[6:]} M={M} (V3.2 o_proj)",
                    lambda M=M, dt=dt: fp8_linear(
                        _e(M, kk, dtype=dt),
                        _e(n, kk, dtype=f8),
                        _e(n // 128, kk // 128, dtype=torch.float32),
                        config=configs.fp8_gemm_config(fp8_gemm.capability(None), M, dt),  # the GEMM at M = 1 too
                    ),
                )
            )
    if "fp8_gemv" in families:  # V4-Flash's projections at decode M (the GEMV), and o_a's 8 groups
        out.extend(_gemv_cases(configs))
    if "block_copy" in families:  # a same-host KV transfer: V3's 72 KiB blocks as int64 words, 61 layers
        from pdserve_kernels.block_copy import copy_blocks

        ids = torch.zeros(128, dtype=torch.int64)
        out.append(
            (
                "block_copy",
                "V3 61 layers, 128 blocks",
                lambda: copy_blocks(
                    _e(61, 256, 9216, dtype=torch.int64), _e(61, 256, 9216, dtype=torch.int64), ids, ids
                ),
            )
        )
    if "kv_checksum" in families:  # the verified hand-off: V3's 72 KiB blocks as int64 words, 61 layers
        from pdserve_kernels.kv_checksum import checksum_blocks

        acc = torch.zeros(1, dtype=torch.int64)
        out.append(
            (
                "kv_checksum",
                "V3 61 layers, 128 blocks of the pool",
                lambda: checksum_blocks(_e(61, 256, 9216, dtype=torch.int64), torch.zeros(128, dtype=torch.int64), acc),
            )
        )
        out.append(
            (
                "kv_checksum",
                "V3 61 layers, a slab of 15",
                lambda: checksum_blocks(_e(61, 15, 9216, dtype=torch.int64), None, acc),
            )
        )
    if "hc" in families:  # V4-Flash's hyper-connection mixes: hc_mult 4, 20 Sinkhorn iterations
        from pdserve_kernels.hyper import hc_mix

        f32 = torch.float32
        out.append(
            (
                "hc",
                "V4-Flash N=4, 20 iterations",
                lambda: hc_mix(_e(64, 24, dtype=f32), _e(24, dtype=f32), _e(3, dtype=f32), 4, 20, 1e-6),
            )
        )
    if "v4_glue" in families:  # V4-Flash's fused glue (kernels/mhc.py, glue.py) at B=1 and 128
        out += v4_glue_cases()
    if "v4_chunk_step" in families:
        out += v4_chunk_step_cases()
    E, k, hidden, inter = 8, 6, 4096, 2048  # V4-Flash expert dims; E small: rows per expert = 6T/8
    routed = lambda T: (_e(T, k, dtype=torch.float32), torch.zeros(T, k, dtype=torch.int32))  # noqa: E731
    for T in (1, 32, 128):  # the three rows-per-expert buckets: <= 16, <= 64, more
        tag = f"T={T} ({T * k / E:g} rows/expert)"
        if "moe" in families:
            out.append(
                (
                    "moe",
                    f"bf16 {tag}",
                    lambda T=T: fused_moe(_e(T, hidden), _e(E, 2 * inter, hidden), _e(E, hidden, inter), *routed(T)),
                )
            )
        if "moe_fp8" in families:
            f8 = torch.float8_e4m3fn
            out.append(
                (
                    "moe_fp8",
                    f"fp8 {tag}",
                    lambda T=T: fused_moe_fp8(
                        _e(T, hidden),
                        _e(E, 2 * inter, hidden, dtype=f8),
                        _e(E, hidden, inter, dtype=f8),
                        _e(E, 2 * inter // 128, hidden // 128, dtype=torch.float32),
                        _e(E, hidden // 128, inter // 128, dtype=torch.float32),
                        *routed(T),
                    ),
                )
            )
        for fam, dot_scaled in (("moe_fp4", False), ("moe_fp4_dot_scaled", True)):
            if fam not in families:
                continue

            def call(T=T, dot_scaled=dot_scaled):
                from pdserve_kernels import fused_moe_fp4 as mod

                cfg = configs.moe_fp4_config(mod.capability(None), T * k / E)
                u8 = torch.uint8
                fused_moe_fp4(
                    _e(T, hidden),
                    _e(E, 2 * inter, hidden // 2, dtype=u8),
                    _e(E, hidden, inter // 2, dtype=u8),
                    _e(E, 2 * inter, hidden // 32, dtype=u8),
                    _e(E, hidden, inter // 32, dtype=u8),
                    *routed(T),
                    swiglu_limit=10.0,
                    config=dataclasses.replace(cfg, dot_scaled=dot_scaled),
                )

            out.append((fam, f"fp4{' dot_scaled' if dot_scaled else ''} {tag}", call))
        if "moe_fp4_frag" in families:  # the fragment layout (`ref_fp4.frag_fp4`)
            from pdserve_kernels import ref_fp4

            def frag(T=T, fb=ref_fp4.FRAG_BYTES, sb=ref_fp4.FRAG_SCALE_BYTES, u8=torch.uint8):
                nb13, kb13 = inter // ref_fp4.FRAG_N, hidden // ref_fp4.FRAG_K
                nb2, kb2 = hidden // ref_fp4.FRAG_N, inter // ref_fp4.FRAG_K
                v13, s13 = _e(E, 2, nb13, kb13, fb, dtype=u8), _e(E, 2, nb13, kb13, sb, dtype=u8)
                v2, s2 = _e(E, nb2, kb2, fb, dtype=u8), _e(E, nb2, kb2, sb, dtype=u8)
                fused_moe_fp4(_e(T, hidden), v13, v2, s13, s2, *routed(T), swiglu_limit=10.0)

            out.append(("moe_fp4_frag", f"fp4 frag {tag}", frag))
        if "moe_fp4_mx8" in families:  # the checkpoint layout, both operands MXFP8-shaped e4m3
            from pdserve_kernels.fused_moe_fp4_mx8 import fused_moe_fp4_mx8

            def mx8(T=T, u8=torch.uint8):
                w13, w2 = _e(E, 2 * inter, hidden // 2, dtype=u8), _e(E, hidden, inter // 2, dtype=u8)
                s13, s2 = _e(E, 2 * inter, hidden // 32, dtype=u8), _e(E, hidden, inter // 32, dtype=u8)
                fused_moe_fp4_mx8(_e(T, hidden), w13, w2, s13, s2, *routed(T), swiglu_limit=10.0)

            out.append(("moe_fp4_mx8", f"fp4 x mxfp8 {tag}", mx8))
    return out


def mma_kinds(ptx: str) -> list[str]:
    """The tensor-core instructions the kernel compiled to (PTX mnemonics without operands), e.g.
    `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` or a block-scaled FP4 `mma...kind::mxf4...`."""
    return sorted(set(re.findall(r"\b((?:w?gmma|mma)\.[\w.:]+)", ptx)))


def _gemv_cases(configs):
    """The FP8 GEMV (fp8_linear's decode path) and the grouped o_a at V4-Flash's dims: o_b 4096 x
    8192 and q_b 32768 x 1024 at M = 1 / 16, float32 x (parity), the FMA variant; o_a 8 x 1024 x
    4096 at M = 1 (GEMV) and M = 64 (the group-aware GEMM)."""
    import dataclasses

    from pdserve_kernels import fp8_gemm
    from pdserve_kernels.fp8_gemm import fp8_grouped_linear, fp8_linear, fp8_swiglu

    f8, f32 = torch.float8_e4m3fn, torch.float32
    w = lambda n, k: (_e(n, k, dtype=f8), _e(n // 128, k // 128, dtype=f32))  # noqa: E731
    fma = lambda: dataclasses.replace(configs.fp8_gemv_config(fp8_gemm.capability(None), 1), fma=True)  # noqa: E731
    return [
        ("fp8_gemv", "bf16 M=1 (V4-Flash o_b)", lambda: fp8_linear(_e(1, 8192), *w(4096, 8192))),
        ("fp8_gemv", "bf16 M=16 (V4-Flash q_b)", lambda: fp8_linear(_e(16, 1024), *w(32768, 1024))),
        ("fp8_gemv", "float32 M=1 (V4-Flash o_b)", lambda: fp8_linear(_e(1, 8192, dtype=f32), *w(4096, 8192))),
        ("fp8_gemv", "bf16 fma M=1 (V4-Flash o_b)", lambda: fp8_linear(_e(1, 8192), *w(4096, 8192), config=fma())),
        ("fp8_gemv", "bf16 M=1 (V4-Flash o_a, 8 groups)", lambda: fp8_grouped_linear(_e(1, 8, 4096), *w(8192, 4096))),
        ("fp8_gemv", "bf16 M=64 (V4-Flash o_a, 8 groups)", lambda: fp8_grouped_linear(_e(64, 8, 4096), *w(8192, 4096))),
        *[("fp8_gemv", f"bf16 M={M} (V4-Flash shared gate + up + SwiGLU)", lambda M=M: fp8_swiglu(_e(M, 4096), w(2048, 4096), w(2048, 4096), 10.0))
          for M in (1, 16)],
        ("fp8_gemv", "float32 M=1 (V4-Flash shared gate + up + SwiGLU)", lambda: fp8_swiglu(_e(1, 4096, dtype=f32), w(2048, 4096), w(2048, 4096), 10.0)),
    ]  # fmt: skip


def _config_str(const: dict) -> str:
    keys = ("BLOCK_H", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_C", "BLOCK_DV", "BLOCK_P")
    return " ".join(f"{k[6:]}={const[k]}" for k in keys if k in const)


def check(arch: int, families) -> list[dict]:
    rows, seen = [], set()
    for fam, label, call in cases(families):
        with as_target(arch) as launches:
            call()
        for fn, args, kwargs in launches:
            const = {k: v for k, v in kwargs.items() if k.isupper()}
            key = (fn.__name__, tuple(sorted(const.items())), kwargs.get("num_warps"), kwargs.get("num_stages"))
            if key in seen:
                continue
            seen.add(key)
            row = dict(
                arch=arch,
                family=fam,
                case=label,
                kernel=fn.__name__,
                config=_config_str(const),
                num_warps=kwargs.get("num_warps", 4),
                num_stages=kwargs.get("num_stages", 3),
            )
            try:
                k = compile_launch(fn, args, kwargs, arch)
                row.update(resource_usage(k.asm["cubin"]), shared=k.metadata.shared, mma=mma_kinds(k.asm["ptx"]))
                row["shared_total"] = row["shared"] + row.get("static_shared", 0)
                row["fits"] = row["shared_total"] <= SMEM_LIMIT[arch]
            except Exception as e:  # a config the compiler rejects is a finding, not a crash
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}", fits=False)
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


HEADER = "| arch | kernel | case | tile | warps | stages | smem B | regs | stack | fits |"


def _fmt(r: dict) -> str:
    if "error" in r:
        return (
            f"| sm_{r['arch']} | {r['kernel']} | {r['case']} | {r['config']} | {r['num_warps']} | "
            f"{r['num_stages']} | - | - | - | no: {r['error'][:80]} |"
        )
    return (
        f"| sm_{r['arch']} | {r['kernel']} | {r['case']} | {r['config']} | {r['num_warps']} | "
        f"{r['num_stages']} | {r['shared_total']} | {r.get('regs', '?')} | {r.get('stack', '?')} | "
        f"{'yes' if r['fits'] else 'NO'} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[120], choices=sorted(SMEM_LIMIT))
    ap.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "bench", "sm120_configs.json"))
    a = ap.parse_args(argv)
    if triton.knobs.runtime.interpret:
        sys.exit("run without TRITON_INTERPRET: this compiles for a GPU target")
    print(HEADER + "\n| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
    rows = [r for arch in a.arch for r in check(arch, a.only)]
    meta = dict(
        triton=triton.__version__,
        torch=torch.__version__,
        limits=SMEM_LIMIT,
        method="triton.compile for GPUTarget('cuda', arch, 32) on the wrappers' own launches; "
        "shared = metadata.shared + static; regs/stack from cuobjdump --dump-resource-usage",
    )
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    bad = [r for r in rows if not r["fits"]]
    print(f"{len(rows)} kernels compiled, {len(bad)} do not fit; JSON: {a.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
