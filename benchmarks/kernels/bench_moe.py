"""Fused MoE rows of the benchmark (`bench.py`) at DeepSeek sizes: bf16 weights and FP8
block-scaled weights (e4m3 + 128 x 128 scales, e4m3 activations), the torch reference, and the
optional tile sweeps ("moe", "moe_fp8")."""

from __future__ import annotations

import torch

from benchmarks.kernels.bench_util import graph_ms, kernel_profile, ms, poisoned_empty, rel_err
from pdserve_kernels import configs, ref, ref_fp8
from pdserve_kernels.fused_moe import fused_moe
from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8

M = configs.MoEConfig
MOE_SWEEP = [
    M(16, 64, 128, 4, 4),
    M(16, 128, 128, 4, 3),
    M(16, 64, 256, 4, 3),
    M(16, 32, 64, 4, 6),
    M(16, 64, 128, 8, 4),
]
# around the default BN 128 (4 warps, 3 stages): the w2 kernel's own BN (its K loop is short:
# I / 128 = 16 steps) and deeper pipelines
MOE_FP8_SWEEP = [
    M(16, 128, 128, 4, 3),
    M(16, 128, 128, 4, 3, block_n2=64),
    M(16, 128, 128, 4, 3, block_n2=32),
    M(16, 128, 128, 4, 3, block_n2=256),
    M(16, 128, 128, 4, 4, block_n2=64),
    M(16, 128, 128, 8, 3, block_n2=256),
]


def fp8_weights(w: torch.Tensor, g: torch.Generator, block: int = 128):
    """e4m3 weights from w (bf16 [E, N, K]) with random per-block scales: the layout and value
    ranges of a DeepSeek FP8 checkpoint (not a quantization of w), made without a float32 copy
    of 7.5G values. rel err of the fp8 rows is against the fp8 reference on these weights."""
    E, N, K = w.shape
    unit = w.float().std().item() / 64  # values ~ N(0, 64^2): most of e4m3's range, no overflow
    q = (w / unit).clamp_(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(E, -(-N // block), -(-K // block), device=w.device, generator=g) + 0.5
    return q, s * unit


def moe_rows(bw, peak, quick, sweeps, prof, emit, batches=None):
    rows = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    E, inter = 256, 2048

    def add(**row):
        rows.append(row)
        emit(row)

    for top_k, hidden in ((8, 7168), (6, 4096)):
        w13 = torch.randn(E, 2 * inter, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        w13 *= hidden**-0.5
        w2 = torch.randn(E, hidden, inter, device=dev, dtype=torch.bfloat16, generator=g)
        w2 *= inter**-0.5
        (q13, s13), (q2, s2) = fp8_weights(w13, g), fp8_weights(w2, g)
        for T in [t for t in ((1, 64) if quick else (1, 16, 64, 256)) if not batches or t in batches]:
            x = torch.randn(T, hidden, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.rand(T, E, device=dev, generator=g).topk(top_k, dim=1).indices.int()
            tw = torch.softmax(torch.randn(T, top_k, device=dev, generator=g), -1)
            want = ref.fused_moe_ref(x, w13, w2, tw, ids).float()
            want8 = ref_fp8.fused_moe_fp8_ref(x, q13, q2, s13, s2, tw, ids).float()
            used = torch.unique(ids).numel()
            act_bytes = 2 * T * hidden * 2
            flops = 2 * T * top_k * 3 * inter * hidden
            floor = max((used * 3 * inter * hidden * 2 + act_bytes) / bw, flops / peak) * 1e3
            scale_bytes = used * (s13[0].numel() + s2[0].numel()) * 4
            floor8 = max((used * 3 * inter * hidden + scale_bytes + act_bytes) / bw, flops / peak) * 1e3
            shape = f"E={E} top{top_k} hidden={hidden} T={T} ({used} experts)"
            cands = [("triton", None, False)]
            cands += [(f"cfg{c}", c, False) for c in MOE_SWEEP] if "moe" in sweeps else []
            cands += [("triton-fp8", None, True)]
            cands += [(f"fp8 cfg{c}", c, True) for c in MOE_FP8_SWEEP] if "moe_fp8" in sweeps else []
            for label, cfg, fp8 in cands:
                if fp8:
                    fn = lambda c=cfg: fused_moe_fp8(x, q13, q2, s13, s2, tw, ids, config=c)
                else:
                    fn = lambda c=cfg: fused_moe(x, w13, w2, tw, ids, config=c)
                try:
                    with poisoned_empty():
                        out = fn()
                    add(
                        kernel="fused_moe",
                        shape=shape,
                        impl=label,
                        ms=graph_ms([fn], replays=10),
                        floor_ms=floor8 if fp8 else floor,
                        rel_err=rel_err(out, want8 if fp8 else want),
                        note=f"eager {ms(fn) * 1e3:.0f} us" if cfg is None else "",
                    )
                except Exception as e:  # a sweep candidate may not compile (resources): report it
                    print(f"{label} failed at {shape}: {str(e)[:200]}", flush=True)
            if T in (1, 16):
                prof += kernel_profile(lambda: fused_moe(x, w13, w2, tw, ids), shape)
                prof += kernel_profile(lambda: fused_moe_fp8(x, q13, q2, s13, s2, tw, ids), f"fp8 {shape}")
            fn = lambda: ref.fused_moe_ref(x, w13, w2, tw, ids)
            add(
                kernel="fused_moe",
                shape=shape,
                impl="torch-ref",
                ms=ms(fn, rep=30),
                floor_ms=floor,
                rel_err=rel_err(fn(), want),
                note="",
            )
        w13 = w2 = q13 = q2 = None  # free the weights before the next expert count
        torch.cuda.empty_cache()
    return rows
