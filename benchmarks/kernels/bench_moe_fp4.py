"""FP4 fused MoE on the GPU at DeepSeek-V4-Flash's expert shape (hidden 4096, I 2048, 256 experts,
top-6): correctness against `ref_fp4.fused_moe_fp4_ref` (bf16 x), time against the weight-bytes
floor and against the bf16 (and fp8) fused MoE at the same shape, a small tile sweep.

    python -m benchmarks.kernels.bench_moe_fp4 [--batch 1 16 64 256] [--no-sweep] [--out DIR]
    python -m benchmarks.kernels.bench_moe_fp4 --smoke      # CPU, interpreter, tiny dims: the code path only

Floor: bytes of the experts actually routed to (packed e2m1 + one ue8m0 byte per 32 values; bf16:
2 bytes a value; fp8: 1 + block scales) + activations, over the measured copy rate (read + write,
as `bench.ceilings`). Times: median of CUDA-graph replays (`bench_util.graph_ms`): the weights
(3.2-12.9 GB) are far larger than L2, so one input set suffices. Writes moe_fp4.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time

import torch

from benchmarks.kernels.bench_util import graph_ms, kernel_profile, poisoned_empty, rel_err
from pdserve_kernels import configs, ref, ref_fp4, ref_fp8
from pdserve_kernels.fused_moe import fused_moe
from pdserve_kernels.fused_moe_fp4 import fused_moe_fp4
from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8

M = configs.MoEConfig
SWEEP = [
    M(16, 64, 128, 4, 3, split_k=1),
    M(16, 64, 128, 4, 3, split_k=2),
    M(16, 64, 128, 4, 3, split_k=4),
    M(16, 64, 128, 4, 3, split_k=8),
    M(16, 64, 256, 4, 3),
    M(16, 64, 128, 4, 3, dot_scaled=True, split_k=1),
    M(16, 64, 128, 4, 3, dot_scaled=True, split_k=8),
    M(16, 128, 128, 8, 3, dot_scaled=True),
]
SWEEP_BIG = [
    M(32, 128, 128, 8, 3),
    M(64, 64, 64, 4, 3),
    M(32, 64, 128, 4, 3, split_k=2),
    M(32, 64, 128, 4, 3, dot_scaled=True, split_k=2),
    M(64, 64, 128, 4, 3, dot_scaled=True),
]
V4_LIMIT = 10.0  # DeepSeek-V4-Flash's swiglu_limit


def random_fp4(E, N, K, dev, g, exp_center):
    """Random packed e2m1 bytes (every code equally likely) and ue8m0 scales around 2**exp_center:
    the layout and magnitudes of a DeepSeek-V4 expert, made without a float copy."""
    packed = torch.randint(0, 256, (E, N, K // 2), device=dev, dtype=torch.uint8, generator=g)
    scale = torch.randint(
        127 + exp_center - 1, 127 + exp_center + 2, (E, N, K // 32), device=dev, dtype=torch.uint8, generator=g
    )
    return packed, scale


def run(args) -> dict:
    dev = "cpu" if args.smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(5)
    E, top_k, hidden, inter = (8, 2, 64, 64) if args.smoke else (256, 6, 4096, 2048)
    batches = [1, 5] if args.smoke else args.batch
    if args.smoke:
        bw = 1e11
    else:
        from benchmarks.kernels.bench import ceilings

        bw, _ = ceilings()
    print(f"copy {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    # e2m1 values ~ 2.2 rms: scales 2**-7 / 2**-6 give weights of rms ~ hidden**-0.5 / I**-0.5
    q13, s13 = random_fp4(E, 2 * inter, hidden, dev, g, -7 if hidden >= 1024 else -3)
    q2, s2 = random_fp4(E, hidden, inter, dev, g, -6 if inter >= 1024 else -3)
    dt = torch.float16 if args.smoke else torch.bfloat16
    dense = None
    if not args.smoke and not args.no_dense:  # the bf16 and fp8 kernels at the same shape
        w13 = torch.randn(E, 2 * inter, hidden, device=dev, dtype=dt, generator=g) * hidden**-0.5
        w2 = torch.randn(E, hidden, inter, device=dev, dtype=dt, generator=g) * inter**-0.5
        from benchmarks.kernels.bench_moe import fp8_weights

        dense = (w13, w2, *fp8_weights(w13, g), *fp8_weights(w2, g))
    rows, prof = [], []
    for T in batches:
        x = torch.randn(T, hidden, device=dev, dtype=dt, generator=g)
        ids = torch.rand(T, E, device=dev, generator=g).topk(top_k, dim=1).indices.int()
        tw = torch.softmax(torch.randn(T, top_k, device=dev, generator=g), -1)
        used = torch.unique(ids).numel()
        act = 2 * T * hidden * 2
        w_fp4 = used * (3 * inter * hidden // 2 + 3 * inter * hidden // 32)
        floor = (w_fp4 + act) / bw * 1e3
        want = ref_fp4.fused_moe_fp4_ref(x, q13, q2, s13, s2, tw, ids, swiglu_limit=V4_LIMIT).float()
        want_free = ref_fp4.fused_moe_fp4_ref(x, q13, q2, s13, s2, tw, ids).float()
        shape = f"V4-Flash T={T} ({used} experts)"
        sweep = [] if args.no_sweep or T not in (1, 64) else (SWEEP if T == 1 else SWEEP_BIG)
        default = configs.moe_fp4_config(90, T * top_k / E)
        cands = [("fp4", None, V4_LIMIT), ("fp4 dot_scaled", dataclasses.replace(default, dot_scaled=True), V4_LIMIT)]
        cands += [("fp4 no-clamp", None, None)] if T == 1 else []
        for label, cfg, limit in cands + [(f"fp4 {c}", c, V4_LIMIT) for c in sweep]:
            if args.smoke and cfg is not None and (cfg.dot_scaled or cfg.block_k > 128):
                continue
            fn = lambda c=cfg, lim=limit: fused_moe_fp4(x, q13, q2, s13, s2, tw, ids, swiglu_limit=lim, config=c)  # noqa: E731
            try:
                with poisoned_empty():
                    out = fn()
                t = graph_ms([fn], replays=10) if dev == "cuda" else float("nan")
                err = rel_err(out, want if limit else want_free)
                rows.append(
                    dict(shape=shape, T=T, impl=label, ms=t, floor_ms=floor, rel_err=err, nan=bool(out.isnan().any()))
                )
                print(
                    f"{shape:32s} {label:80s} {t * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us  "
                    f"x{t / floor:5.2f}  rel {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # a sweep candidate may not compile: report it
                print(f"{label} failed at {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if dense is not None:
            w13, w2, f13, fs13, f2, fs2 = dense
            b_floor = (used * 3 * inter * hidden * 2 + act) / bw * 1e3
            f_floor = (used * (3 * inter * hidden + (fs13[0].numel() + fs2[0].numel()) * 4) + act) / bw * 1e3
            for label, fn, fl, oracle in (
                (
                    "bf16 fused_moe",
                    lambda: fused_moe(x, w13, w2, tw, ids),
                    b_floor,
                    lambda: ref.fused_moe_ref(x, w13, w2, tw, ids),
                ),
                (
                    "fp8 fused_moe_fp8",
                    lambda: fused_moe_fp8(x, f13, f2, fs13, fs2, tw, ids),
                    f_floor,
                    lambda: ref_fp8.fused_moe_fp8_ref(x, f13, f2, fs13, fs2, tw, ids),
                ),
            ):
                out = fn()
                t = graph_ms([fn], replays=10)
                err = rel_err(out, oracle().float()) if T <= 64 else float("nan")
                rows.append(dict(shape=shape, T=T, impl=label, ms=t, floor_ms=fl, rel_err=err, nan=False))
                print(
                    f"{shape:32s} {label:80s} {t * 1e3:8.1f} us  floor {fl * 1e3:7.1f} us  "
                    f"x{t / fl:5.2f}  rel {err:.1e}",
                    flush=True,
                )
        if dev == "cuda" and T in (1, 64):
            prof += kernel_profile(
                lambda: fused_moe_fp4(x, q13, q2, s13, s2, tw, ids, swiglu_limit=V4_LIMIT), f"fp4 {shape}", top=4
            )
            cfg_ds = dataclasses.replace(configs.moe_fp4_config(90, T * top_k / E), dot_scaled=True)
            try:
                prof += kernel_profile(
                    lambda: fused_moe_fp4(x, q13, q2, s13, s2, tw, ids, swiglu_limit=V4_LIMIT, config=cfg_ds),
                    f"fp4 dot_scaled {shape}",
                    top=4,
                )
            except Exception as e:  # noqa: BLE001  (reported above with its row)
                prof.append(f"profile fp4 dot_scaled {shape}: {type(e).__name__}")
    print("\n".join(prof), flush=True)
    return dict(bw=bw, rows=rows, profile=prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-dense", action="store_true", help="skip the bf16 / fp8 comparison rows")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny dims")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.time()
    head = dict(date=str(datetime.date.today()), torch=torch.__version__)
    if torch.cuda.is_available() and not args.smoke:
        p = torch.cuda.get_device_properties(0)
        head.update(device=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_fp4.json"), "w") as f:
        json.dump(dict(head=head, **res), f, indent=1)
    print("\n| shape | impl | us | floor us | x floor | rel err |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in res["rows"]:
        print(
            f"| {r['shape']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | "
            f"{r['ms'] / r['floor_ms']:.2f} | {r['rel_err']:.1e} |"
        )
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
