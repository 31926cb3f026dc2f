"""Sparse MLA decode rows of the benchmark (`bench.py`): the Triton kernel with its default
config, the same with the split merge in a second launch, the FP8-KV variant, the per-head
baseline and the torch reference, plus the optional sweeps: tiles ("mla"), split count x merge placement ("merge", B <= 16) and
B = 1 latency ("latency")."""

from __future__ import annotations

import dataclasses
import math

import torch

from benchmarks.kernels.baseline import sparse_mla_decode_per_head
from benchmarks.kernels.bench_util import compiled_kernels, graph_ms, kernel_profile, ms, poisoned_empty, rel_err
from pdserve_kernels import configs, kv_fp8, ref, sparse_mla
from pdserve_kernels._launch import capability, cdiv, sm_count
from pdserve_kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_fp8

C = configs.MLAConfig
MLA_SWEEP = [
    C(16, 32, 4, 3),
    C(16, 64, 4, 2),
    C(32, 32, 4, 2),
    C(64, 32, 8, 2),
    C(64, 64, 8, 2),
    C(64, 32, 16, 2),
    C(64, 64, 16, 2),
    C(128, 32, 16, 2),
    C(64, 16, 8, 4),
    C(32, 16, 4, 4),
]
# merge sweep: split count (waves high, so max_splits decides) x tile rows x where the merge runs
MERGE_SWEEP = [
    C(16, 64, 4, 2, waves=64, min_tiles=1, max_splits=p, fused_merge=f) for p in (4, 8, 16, 32) for f in (True, False)
]
MERGE_SWEEP += [C(16, 32, 4, 2, waves=64, min_tiles=1, max_splits=p, fused_merge=True) for p in (8, 16)]
# B=1 latency sweep (merge in a second launch): heads per program x rows per tile x splits
LATENCY_SWEEP = [
    C(bh, bn, w, st, waves=64, min_tiles=1, max_splits=p)
    for bh, bn, w, st, p in (
        (16, 64, 4, 2, 32),
        (16, 64, 4, 1, 32),
        (16, 32, 4, 2, 64),
        (16, 32, 4, 1, 64),
        (16, 16, 4, 2, 128),
        (32, 64, 4, 2, 32),
        (32, 32, 4, 2, 64),
        (64, 64, 8, 2, 32),
        (64, 32, 8, 2, 64),
        (64, 32, 4, 2, 64),
        (64, 16, 4, 2, 128),
    )
]


def plan(B: int, H: int, K: int, D: int, dv: int, fmt: str, cfg: configs.MLAConfig | None):
    """(config, splits) the wrapper will use for this shape."""
    cfg = cfg or configs.mla_config(capability(torch.device("cuda")), fmt, H, B, has_tail=D > dv)
    tiles = cdiv(K, cfg.block_n)
    splits = sparse_mla.num_splits(B, cdiv(H, cfg.block_h), tiles, sm_count(torch.device("cuda")), cfg)
    return cfg, splits


def describe(cfg: configs.MLAConfig, splits: int) -> str:
    merge = "direct" if splits == 1 else ("fused" if cfg.fused_merge else "2 launches")
    return f"BH{cfg.block_h} BN{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} P={splits} {merge}"


def mla_rows(bw, peak, quick, sweeps, fp8, prof, emit, batches=None):
    rows = []
    N = 262144
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    pool = torch.randn(N, 576, device=dev, dtype=torch.bfloat16, generator=g)
    pool_fp8 = kv_fp8.pack_kv_fp8(pool, 512) if fp8 else None
    shapes = [("V3.2", H, B, 576, 512, 2048, False) for H in (16, 64, 128) for B in (1, 16, 64)]
    shapes += [("V4-Flash", 64, B, 512, 512, 640, True) for B in (1, 16, 64)]
    if quick:
        shapes = [s for s in shapes if s[2] in (1, 64) and s[1] in (64, 128)]
    if batches:
        shapes = [s for s in shapes if s[2] in batches]

    def add(**row):
        rows.append(row)
        emit(row)

    for name, H, B, D, dv, K, has_sink in shapes:
        shape = f"{name} H={H} B={B} K={K}"
        kv = pool[:, :D] if D < 576 else pool
        q = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        idx = torch.randint(0, N, (B, 1, K), device=dev, dtype=torch.int32, generator=g)
        sink = torch.randn(H, device=dev, generator=g) if has_sink else None
        scale = D**-0.5
        ref_bf16 = ref.sparse_mla_decode_ref(q, kv, idx, scale, dv, sink=sink)[0]
        r_out = ref.sparse_mla_decode_ref(q.float(), kv.float(), idx, scale, dv, sink=sink)[0]
        kv_bytes = B * K * D * 2
        bytes_ = kv_bytes + q.numel() * 2 + B * H * dv * 2 + idx.numel() * 4
        flops = 2 * B * H * K * (D + dv)
        floor = max(bytes_ / bw, flops / peak) * 1e3
        sets = max(1, min(64, math.ceil(2.5e8 / kv_bytes)))
        idx_sets = [torch.randint(0, N, (B, 1, K), device=dev, dtype=torch.int32, generator=g) for _ in range(sets)]
        default, _ = plan(B, H, K, D, dv, "bf16", None)
        cands = [("triton", default), ("triton-2launch", dataclasses.replace(default, fused_merge=False))]
        if "mla" in sweeps:
            cands += [(f"cfg{c}", c) for c in MLA_SWEEP]
        if "merge" in sweeps and B in (1, 16):
            cands += [("merge-sweep", c) for c in MERGE_SWEEP]
        if "latency" in sweeps and B == 1:
            cands += [("latency-sweep", c) for c in LATENCY_SWEEP]
        for label, cfg in cands:
            fn = lambda c=cfg: sparse_mla_decode(q, kv, idx, scale, dv, sink=sink, config=c)
            calls = [lambda c=cfg, i=i: sparse_mla_decode(q, kv, i, scale, dv, sink=sink, config=c) for i in idx_sets]
            try:
                with poisoned_empty(), compiled_kernels() as compiled:
                    out, _ = fn()
                info = compiled.get("_mla_split_kernel")
                res = (
                    f"regs {info.n_regs} spills {info.n_spills} smem {info.metadata.shared}" if info is not None else ""
                )
                eager = f"eager {ms(fn) * 1e3:.0f} us; " if label.startswith("triton") else ""
                add(
                    kernel="sparse_mla",
                    shape=shape,
                    impl=label,
                    ms=graph_ms(calls),
                    floor_ms=floor,
                    rel_err=rel_err(out, r_out),
                    note=f"{describe(cfg, plan(B, H, K, D, dv, 'bf16', cfg)[1])}; {eager}{res}",
                )
            except Exception as e:  # a sweep candidate may not compile (resources): report it
                print(f"{label} {cfg} failed at {shape}: {str(e)[:200]}", flush=True)
        if fp8 and name == "V3.2":
            fb = B * K * 656 + q.numel() * 2 + B * H * dv * 2
            f_floor = max(fb / bw, flops / peak) * 1e3
            fn = lambda: sparse_mla_decode_fp8(q, pool_fp8, idx, scale, dv, sink=sink)
            calls = [lambda i=i: sparse_mla_decode_fp8(q, pool_fp8, i, scale, dv, sink=sink) for i in idx_sets]
            with poisoned_empty():
                out, _ = fn()
            want = kv_fp8.sparse_mla_decode_fp8_ref(q.float(), pool_fp8, idx, scale, dv)[0]
            add(
                kernel="sparse_mla",
                shape=shape,
                impl="triton-fp8",
                ms=graph_ms(calls),
                floor_ms=f_floor,
                rel_err=rel_err(out, want),
                note=f"{describe(*plan(B, H, K, D, dv, 'fp8', None))}; eager {ms(fn) * 1e3:.0f} us",
            )
        if (H, B) in ((64, 64), (128, 64), (64, 1)):
            for c in (default, dataclasses.replace(default, fused_merge=False)):
                prof += kernel_profile(
                    lambda c=c: sparse_mla_decode(q, kv, idx, scale, dv, sink=sink, config=c),
                    f"{shape} {'fused' if c.fused_merge else '2-launch'}",
                )
        fn = lambda: sparse_mla_decode_per_head(q, kv, idx, scale, dv, sink=sink)
        add(
            kernel="sparse_mla",
            shape=shape,
            impl="per-head",
            ms=ms(fn, rep=40),
            floor_ms=floor,
            rel_err=rel_err(fn()[0], r_out),
            note="",
        )
        fn = lambda: ref.sparse_mla_decode_ref(q, kv, idx, scale, dv, sink=sink)
        add(
            kernel="sparse_mla",
            shape=shape,
            impl="torch-ref",
            ms=ms(fn, rep=40),
            floor_ms=floor,
            rel_err=rel_err(ref_bf16, r_out),
            note="",
        )
        torch.cuda.empty_cache()
    return rows
