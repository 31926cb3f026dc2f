"""FP4 fused MoE on the GPU at DeepSeek-V4-Flash's expert shape (hidden 4096, I 2048, 256 experts,
top-6, bf16 x, `swiglu_limit` 10): each variant checked against `ref_fp4.fused_moe_fp4_ref` on
fresh random inputs, then timed against the weight-bytes floor of the experts it touches.

    python -m benchmarks.kernels.bench_moe_fp4 [--tokens 1 16 64 128] [--sets 4] [--no-sweep] [--out DIR]
        [--variants frag mx8 ...]
    python -m benchmarks.kernels.bench_moe_fp4 --smoke      # CPU, interpreter, tiny dims: the code path only

Variants: `checkpoint` (the checkpoint layout, the register-dequant kernels, default config),
`checkpoint dot_scaled` (the same weights through `tl.dot_scaled`), `frag` (the same weights
re-laid once by `frag_experts`, the fragment-layout kernels, default config), `mx8` (the checkpoint
weights x MXFP8 activations, `fused_moe_fp4_mx8`: e4m3 x e4m3 `tl.dot_scaled`, sm_120's
block-scaled MMA; checked against `fused_moe_fp4_ref(mxfp8_act=True)`, its rel err against the
bf16-activation reference reported as the accuracy cost, and the MXFP8 quantizer's bits against
`ref_fp4.quant_mxfp8` at [T, hidden]) and a small sweep of the fragment kernels' configs (stages,
w2 row blocks a program, split K); `--variants` picks some by label. Exits 1 when a variant's rel err exceeds
1e-2 against its reference, has a NaN, or the quantizer's bits differ. Times: median of CUDA-graph replays of `--sets` different routings per call (so the
experts read are cold in L2). Floor: FP4 bytes + ue8m0 bytes of the distinct experts each routing
reads, averaged over the sets, + activations, over the device-copy rate measured in the same run
(1 GiB, read + write counted). Writes moe_fp4.json to --out.
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
from pdserve_kernels import configs, ref_fp4
from pdserve_kernels.fused_moe_fp4 import frag_experts, fused_moe_fp4
from pdserve_kernels.fused_moe_fp4_mx8 import fused_moe_fp4_mx8
from pdserve_kernels.mxfp8 import quant_mxfp8

M = configs.MoEConfig
SWEEP = [  # (label, layout, config); the default is timed as "frag"
    ("frag 4 stages", "frag", M(16, 64, 128, 4, 4, 128)),
    ("frag w2x1", "frag", M(16, 64, 128, 4, 3, 64)),
    ("frag w2x4", "frag", M(16, 64, 128, 4, 3, 256)),
    ("frag w2x4 4 stages", "frag", M(16, 64, 128, 4, 4, 256)),
    ("frag split 3", "frag", M(16, 64, 128, 4, 3, 128, split_k=3)),
]
V4_LIMIT = 10.0  # DeepSeek-V4-Flash's swiglu_limit
MAX_REL_ERR = 1e-2  # bf16 output against the float32 reference of the same numerics


def random_fp4(E, N, K, dev, g, exp_center):
    """Random packed e2m1 bytes (every code equally likely) and ue8m0 scales around 2**exp_center:
    the layout and magnitudes of a DeepSeek-V4 expert, made without a float copy."""
    packed = torch.randint(0, 256, (E, N, K // 2), device=dev, dtype=torch.uint8, generator=g)
    scale = torch.randint(
        127 + exp_center - 1, 127 + exp_center + 2, (E, N, -(-K // 32)), device=dev, dtype=torch.uint8, generator=g
    )
    return packed, scale


def copy_rate() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, read + write counted."""
    from triton.testing import do_bench

    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median") * 1e-3
    return 2 * src.numel() * 4 / t


def routings(T, E, top_k, hidden, dev, g, dt, sets):
    """`sets` fresh (x, topk_ids, topk_weights)."""
    out = []
    for _ in range(sets):
        x = torch.randn(T, hidden, device=dev, generator=g).to(dt)
        ids = torch.rand(T, E, device=dev, generator=g).topk(top_k, dim=1).indices.int()
        tw = torch.softmax(torch.randn(T, top_k, device=dev, generator=g), -1)
        out.append((x, ids, tw))
    return out


def variants(T, top_k, E, sweep):
    """(label, layout, config) to run at T tokens."""
    default = configs.moe_fp4_config(90, T * top_k / E)
    out = [
        ("checkpoint", "checkpoint", None),
        ("checkpoint dot_scaled", "checkpoint", dataclasses.replace(default, dot_scaled=True)),
        ("frag", "frag", None),
        ("mx8", "mx8", None),
    ]
    return out + (SWEEP if sweep else [])


def quantizer_exact(T, hidden, dev, g) -> bool:
    """The MXFP8 quantizer (GPU: the hardware conversion) gives the reference's bits."""
    x = torch.randn(T, hidden, device=dev, generator=g) * torch.exp2(
        torch.randint(-8, 8, (T, 1), device=dev, generator=g).float()
    )
    q, s = quant_mxfp8(x.to(torch.bfloat16))
    want_q, want_s = ref_fp4.quant_mxfp8(x.to(torch.bfloat16).float())
    return torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def run(args) -> dict:
    dev = "cpu" if args.smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(5)
    E, top_k, hidden, inter = (8, 2, 256, 128) if args.smoke else (256, 6, 4096, 2048)
    tokens = [1, 5] if args.smoke else args.tokens
    bw = 1e11 if args.smoke else copy_rate()
    print(f"copy {bw / 1e12:.2f} TB/s (1 GiB, read + write)", flush=True)
    # e2m1 values ~ 2.2 rms: scales 2**-7 / 2**-6 give weights of rms ~ hidden**-0.5 / I**-0.5
    q13, s13 = random_fp4(E, 2 * inter, hidden, dev, g, -7 if hidden >= 1024 else -3)
    q2, s2 = random_fp4(E, hidden, inter, dev, g, -6 if inter >= 1024 else -3)
    weights = {"checkpoint": (q13, q2, s13, s2), "frag": frag_experts(q13, q2, s13, s2)}
    weights["mx8"] = weights["checkpoint"]
    dt = torch.float16 if args.smoke else torch.bfloat16
    per_expert = 3 * inter * hidden // 2 + 3 * inter * hidden // 32
    rows, prof, failed = [], [], []
    for T in tokens:
        sets = routings(T, E, top_k, hidden, dev, g, dt, 1 if args.smoke else args.sets)
        used = sum(torch.unique(ids).numel() for _, ids, _ in sets) / len(sets)
        floor = (used * per_expert + 2 * T * hidden * 2) / bw * 1e3  # ms
        x, ids, tw = sets[0]
        want = ref_fp4.fused_moe_fp4_ref(x, q13, q2, s13, s2, tw, ids, swiglu_limit=V4_LIMIT).float()
        picked = [v for v in variants(T, top_k, E, not args.no_sweep and not args.smoke) if v[0] in args.variants]
        if any(layout == "mx8" for _, layout, _ in picked):
            want_mx8 = ref_fp4.fused_moe_fp4_ref(x, q13, q2, s13, s2, tw, ids, swiglu_limit=V4_LIMIT, mxfp8_act=True)
            exact = quantizer_exact(T, hidden, dev, g)
            print(f"T={T:4d} MXFP8 quantizer bits equal the reference's: {exact}", flush=True)
            failed += [] if exact else [f"quantizer T={T}"]
        for label, layout, cfg in picked:
            if args.smoke and cfg is not None and cfg.dot_scaled:
                continue
            w, fn = weights[layout], fused_moe_fp4_mx8 if layout == "mx8" else fused_moe_fp4
            calls = [
                lambda x=x, ids=ids, tw=tw, w=w, c=cfg, fn=fn: fn(
                    x, w[0], w[1], w[2], w[3], tw, ids, swiglu_limit=V4_LIMIT, config=c
                )
                for x, ids, tw in sets
            ]
            try:
                with poisoned_empty():
                    out = calls[0]()
                err = rel_err(out, want_mx8.float() if layout == "mx8" else want)
                t = graph_ms(calls, replays=args.replays) if dev == "cuda" else float("nan")
            except Exception as e:  # a sweep candidate may not compile: report it
                print(f"{label} failed at T={T}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            row = dict(T=T, experts=used, impl=label, us=t * 1e3, floor_us=floor * 1e3, rel_err=err)
            row["nan"] = bool(out.isnan().any())
            cost = f"  vs bf16-act ref {rel_err(out, want):.1e}" if layout == "mx8" else ""
            row["rel_err_bf16_act"] = rel_err(out, want)
            rows.append(row)
            failed += [f"{label} T={T}"] if row["nan"] or err > MAX_REL_ERR else []
            print(
                f"T={T:4d} ({used:5.1f} experts) {label:24s} {t * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us  "
                f"x{t / floor:5.2f}  rel {err:.1e}{cost}{'  NaN!' if row['nan'] else ''}",
                flush=True,
            )
        if dev == "cuda" and T in (1, 64, 128):
            for label, layout, cfg in picked[:5]:  # the variants before the sweep
                w, fn = weights[layout], fused_moe_fp4_mx8 if layout == "mx8" else fused_moe_fp4
                run1 = lambda w=w, fn=fn, c=cfg: fn(x, w[0], w[1], w[2], w[3], tw, ids, swiglu_limit=V4_LIMIT, config=c)  # noqa: E731
                prof += kernel_profile(run1, f"{label} T={T}", top=4)
    print("\n".join(prof), flush=True)
    return dict(copy_GBps=bw / 1e9, rows=rows, profile=prof, failed=failed)


def table(rows) -> str:
    out = [
        "| T | experts | impl | us | floor us | x floor | rel err |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['T']} | {r['experts']:.1f} | {r['impl']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
            f"{r['us'] / r['floor_us']:.2f} | {r['rel_err']:.1e} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--sets", type=int, default=4, help="routings per timing (cold experts)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny dims")
    labels = [v[0] for v in variants(1, 6, 256, True)]
    ap.add_argument("--variants", nargs="+", default=labels, choices=labels, metavar="LABEL", help=", ".join(labels))
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
    print(f"\n{head}\n{table(res['rows'])}\ndone in {time.time() - t0:.0f}s", flush=True)
    if res["failed"]:
        raise SystemExit(f"FAILED (rel err > {MAX_REL_ERR:g}, NaN, or quantizer bits): {', '.join(res['failed'])}")


if __name__ == "__main__":
    main()
