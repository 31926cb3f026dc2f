"""The FP8 GEMV (`fp8_gemv`, what `fp8_linear` runs at decode M) and V4's grouped o_a projection
on the GPU at DeepSeek-V4-Flash's projection shapes, in one command:

    python -m benchmarks.kernels.bench_fp8_gemv [--rows 1 2 4 8 16] [--tp 1 4] [--no-sweep] [--out DIR]
    TRITON_INTERPRET=1 python -m benchmarks.kernels.bench_fp8_gemv --smoke   # CPU: the code path only

1. Checks (exit 1 on any failure): the GEMV in each mode (e4m3 dot, bf16 dot, FMA, a split per
   K step), today's GEMM and the grouped linear on each path (GEMV, group-aware GEMM, dequantize
   + one batched matmul), bf16 x against the float64 reference on fresh random inputs of odd
   sizes with NaN-poisoned outputs; a CUDA-graph replay of the split-K GEMV over new x.
2. Times, per tensor-parallel size (--tp: column-parallel N and row-parallel K divided, o_a's
   groups too; q_a, kv and the indexer's q_b are replicated) and M: the GEMV (default config,
   and with --sweep-less runs skipped, a few variants), today's GEMM kernel
   (`configs.fp8_gemm_config`), the torch baseline (dequantize to bf16, then matmul, every
   call) and cuBLAS on a bf16 weight dequantized at load; o_a grouped in one launch against
   the per-group loop it replaced, FP8 and bf16, with the kernel launches a call makes.
Floor: weight bytes as stored (e4m3 + float32 block scales; bf16: 2 B a value) over the copy
rate measured in the same run (1 GiB device copy, read + write counted); the read-only rate (a
1 GiB sum) is printed beside it. Times: median of CUDA-graph replays over enough weight copies
to exceed the 50 MB L2. Writes fp8_gemv.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_util import graph_ms, poisoned_empty, rel_err
from pdserve_kernels import configs, ref_fp8
from pdserve_kernels._launch import capability
from pdserve_kernels.fp8_gemm import fp8_grouped_linear, fp8_linear

B = (128, 128)
L2_BYTES = 50 * 2**20
GV = configs.Fp8GemvConfig
# V4-Flash (hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8 x o_lora 1024, indexer 64 x 128,
# shared expert 2048): (name, N, K, how tensor parallelism cuts it)
SHAPES = [
    ("q_a_proj", 1024, 4096, "replicated"),
    ("kv_proj", 512, 4096, "replicated"),
    ("q_b_proj", 32768, 1024, "column"),
    ("o_b_proj", 4096, 8192, "row"),
    ("indexer.q_b_proj", 8192, 1024, "replicated"),
    ("shared.gate_proj", 2048, 4096, "column"),
    ("shared.down_proj", 4096, 2048, "row"),
]
O_A = (8, 1024, 4096)  # groups, rows a group, K a group
SMOKE_SHAPES = [("small", 96, 160, "replicated"), ("odd", 75, 300, "column")]


def sweep(cc: int) -> list[tuple[str, GV]]:
    base = configs.fp8_gemv_config(cc, 1)
    r = dataclasses.replace
    return [
        ("waves 2", r(base, waves=2)),
        ("waves 8", r(base, waves=8)),
        ("3 stages", r(base, num_stages=3)),
        ("BN 128", r(base, block_n=128)),
        ("fma", r(base, fma=True)),
    ]


def copy_rates() -> tuple[float, float]:
    """(bytes/s of a 1 GiB device copy, read + write counted; bytes/s of a 1 GiB sum, read only)."""
    from triton.testing import do_bench

    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median") * 1e-3
    t_read = do_bench(lambda: src.sum(), warmup=25, rep=200, return_mode="median") * 1e-3
    return 2 * src.numel() * 4 / t_copy, src.numel() * 4 / t_read


def eager_ms(calls, reps: int = 1) -> float:
    """The CPU stand-in for graph_ms (smoke runs): wall time of one call, eager."""
    t = time.perf_counter()
    for _ in range(reps):
        for c in calls:
            c()
    return 1e3 * (time.perf_counter() - t) / (reps * len(calls))


def launches(fn) -> int:
    """CUDA kernels one call of fn launches (torch profiler); 0 on CPU."""
    if not torch.cuda.is_available():
        return 0
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def fp8_weights(N, K, dev, g, copies):
    return [ref_fp8.quant_block_fp8(torch.randn(N, K, device=dev, generator=g) * K**-0.5, B) for _ in range(copies)]


def quantizes(x: torch.Tensor, cfg=None) -> bool:
    """Whether fp8_linear / fp8_grouped_linear quantize x to e4m3 with this config (None: the
    default the wrapper picks for x's rows), so the reference must too."""
    cc, M = capability(x.device), x.shape[0]
    cfg = cfg or configs.fp8_gemv_config(cc, M, x.dtype) or configs.fp8_gemm_config(cc, M, x.dtype)
    if x.dtype == torch.float32 or getattr(cfg, "fma", False) or getattr(cfg, "dequant", False):
        return False
    return cfg.fp8_act


def per_group(x, q, s, G):
    """The o_a form the grouped launch replaced: one fp8_linear a group, then a cat."""
    R = q.shape[0] // G
    sr = R // B[0]
    return torch.cat([fp8_linear(x[:, g], q[g * R : (g + 1) * R], s[g * sr : (g + 1) * sr], B) for g in range(G)], -1)


def checks(dev: str, dt: torch.dtype) -> list[dict]:
    """Odd sizes, every path, poisoned outputs, float64 references (the GPU's own compile)."""
    out, g = [], torch.Generator(device=dev).manual_seed(11)
    modes = [("fp8_act", None), ("bf16 dot", GV(64, 128, 4, 3, fp8_act=False)), ("fma", GV(64, 128, 4, 3, fma=True))]
    modes.append(("split per K step", GV(64, 128, 4, 3, waves=10**4)))
    for M, N, K, blk in ((1, 75, 4100, B), (3, 1000, 200, B), (7, 130, 113, (32, 32)), (16, 2049, 1536, B)):
        q, s = ref_fp8.quant_block_fp8(torch.randn(N, K, device=dev, generator=g) * K**-0.5, blk)
        x = torch.randn(M, K, device=dev, generator=g).to(dt)
        bias = torch.randn(N, device=dev, generator=g).to(dt)
        for name, cfg in [*modes, ("gemm", configs.fp8_gemm_config(capability(x.device), M, dt))]:
            with poisoned_empty():
                y = fp8_linear(x, q, s, blk, bias=bias, config=cfg)
            act = quantizes(x, cfg)
            want = ref_fp8.fp8_linear_ref(x.double(), q, s, blk, bias=bias, act_quant=act)
            out.append(dict(check=f"linear {name} M={M} {N}x{K}", err=rel_err(y, want), nan=bool(y.isnan().any())))
    G, R, K = 3, 256, 300
    q, s = ref_fp8.quant_block_fp8(torch.randn(G * R, K, device=dev, generator=g) * K**-0.5, B)
    for M in (1, 5, 40, 600):  # GEMV, GEMV, group-aware GEMM, dequant + batched matmul (by M)
        x = torch.randn(M, G, K + 8, device=dev, generator=g).to(dt)[:, :, :K]
        with poisoned_empty():
            y = fp8_grouped_linear(x, q, s, B)
        act = quantizes(x)
        want = ref_fp8.grouped_linear_ref(x.double(), q, s, B, act_quant=act)
        out.append(dict(check=f"grouped M={M}", err=rel_err(y, want), nan=bool(y.isnan().any())))
    return out + graph_check(dev, dt, g)


def graph_check(dev: str, dt: torch.dtype, g: torch.Generator) -> list[dict]:
    """A captured split-K GEMV replayed over new x (the arrival counters reset themselves)."""
    if dev != "cuda":
        return []
    q, s = ref_fp8.quant_block_fp8(torch.randn(1024, 4096, device=dev, generator=g) * 4096**-0.5, B)
    x = torch.randn(2, 4096, device=dev, generator=g).to(dt)
    fp8_linear(x, q, s, B)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, q, s, B)
    rows = []
    for i in range(3):
        x.copy_(torch.randn(2, 4096, device=dev, generator=g))
        graph.replay()
        want = ref_fp8.fp8_linear_ref(x.double(), q, s, B, act_quant=quantizes(x))
        rows.append(dict(check=f"graph replay {i}", err=rel_err(y, want), nan=bool(y.isnan().any())))
    return rows


def time_linear(name, N, K, M, ws, x, floor_us, timer, cc, do_sweep) -> dict:
    q0, s0 = ws[0]
    gemm_cfg = configs.fp8_gemm_config(cc, M, x.dtype)
    variants = [("gemv", None), ("gemm", gemm_cfg)] + (sweep(cc) if do_sweep else [])
    row = dict(shape=name, N=N, K=K, M=M, floor_us=floor_us, us={}, err={}, launches={})
    for label, cfg in variants:
        act = quantizes(x, cfg)
        with poisoned_empty():
            y = fp8_linear(x, q0, s0, B, config=cfg)
        row["err"][label] = rel_err(y, ref_fp8.fp8_linear_ref(x.double(), q0, s0, B, act_quant=act))
        row["us"][label] = 1e3 * timer([lambda q=q, s=s, c=cfg: fp8_linear(x, q, s, B, config=c) for q, s in ws])
        if label in ("gemv", "gemm"):
            row["launches"][label] = launches(lambda c=cfg: fp8_linear(x, q0, s0, B, config=c))
    deq = lambda q, s: ref_fp8.dequant_block_fp8(q, s, B, x.dtype)  # noqa: E731
    row["us"]["naive"] = 1e3 * timer([lambda q=q, s=s: x @ deq(q, s).t() for q, s in ws])
    w16 = [deq(q, s) for q, s in ws[: max(1, len(ws) // 2)]]  # bf16: twice the bytes, half the copies
    row["us"]["bf16 cuBLAS"] = 1e3 * timer([lambda w=w: F.linear(x, w) for w in w16])
    return row


def time_o_a(G, R, K, M, dev, g, bw, timer, copies_for) -> dict:
    fp8_bytes = G * R * K + 4 * (G * R // 128) * -(-K // 128)
    copies = copies_for(fp8_bytes)
    ws = fp8_weights(G * R, K, dev, g, copies)
    x = torch.randn(M, G, K, device=dev, generator=g).to(torch.bfloat16 if dev == "cuda" else torch.float16)
    want = ref_fp8.grouped_linear_ref(x.double(), *ws[0], B, act_quant=quantizes(x))
    row = dict(shape=f"o_a_proj {G} x {R} x {K}", M=M, floor_us=1e6 * fp8_bytes / bw, us={}, err={}, launches={})
    row["bf16_floor_us"] = 1e6 * 2 * G * R * K / bw
    fns = {
        "fp8 grouped": lambda q, s: fp8_grouped_linear(x, q, s, B),
        "fp8 per-group loop": lambda q, s: per_group(x, q, s, G),
    }
    for label, fn in fns.items():
        row["err"][label] = rel_err(fn(*ws[0]), want)
        row["us"][label] = 1e3 * timer([lambda q=q, s=s, fn=fn: fn(q, s) for q, s in ws])
        row["launches"][label] = launches(lambda fn=fn: fn(*ws[0]))
    w16 = [ref_fp8.dequant_block_fp8(q, s, B, x.dtype) for q, s in ws[: max(1, len(ws) // 2)]]
    bfns = {
        "bf16 grouped (one bmm)": lambda w: ref_fp8.grouped_mm(x, w),
        "bf16 einsum (before)": lambda w: torch.einsum("tgi,goi->tgo", x, w.view(G, R, K)).flatten(1),
        "bf16 per-group loop": lambda w: torch.cat([x[:, i] @ w[i * R : (i + 1) * R].t() for i in range(G)], -1),
    }
    ref16 = torch.einsum("tgi,goi->tgo", x.double(), w16[0].double().view(G, R, K)).flatten(1)
    for label, fn in bfns.items():
        row["err"][label] = rel_err(fn(w16[0]), ref16)
        row["us"][label] = 1e3 * timer([lambda w=w, fn=fn: fn(w) for w in w16])
        row["launches"][label] = launches(lambda fn=fn: fn(w16[0]))
    return row


def tp_shapes(tp: int, smoke: bool):
    for name, N, K, cut in SMOKE_SHAPES if smoke else SHAPES:
        yield name, N // tp if cut == "column" else N, K // tp if cut == "row" else K


def run(args) -> dict:
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    dt = torch.float16 if smoke else torch.bfloat16  # the interpreter has no bf16 dots
    bw, read_bw = (1e11, 1e11) if smoke else copy_rates()
    print(f"copy {bw / 1e12:.3g} TB/s (read + write), read-only {read_bw / 1e12:.3g} TB/s", flush=True)
    check_rows = checks(dev, dt)
    for r in check_rows:
        print(f"check {r['check']}: rel err {r['err']:.1e}{' NaN' if r['nan'] else ''}", flush=True)
    timer = eager_ms if smoke else graph_ms
    cc = capability(torch.device(dev))
    copies_for = lambda nbytes: 1 if smoke else max(1, -(-2 * L2_BYTES // nbytes))  # noqa: E731
    rows, o_a_rows = [], []
    for tp in args.tp:
        for name, N, K in tp_shapes(tp, smoke):
            wbytes = N * K + 4 * -(-N // 128) * -(-K // 128)
            ws = fp8_weights(N, K, dev, g, copies_for(wbytes))
            for M in args.rows:
                x = torch.randn(M, K, device=dev, generator=g).to(dt)
                row = time_linear(name, N, K, M, ws, x, 1e6 * wbytes / bw, timer, cc, not args.no_sweep and not smoke)
                rows.append(dict(row, tp=tp))
                print(_fmt(rows[-1]), flush=True)
            del ws
        G, R, K = (2, 256, 384) if smoke else (O_A[0] // tp, O_A[1], O_A[2])
        for M in args.rows:
            o_a_rows.append(dict(time_o_a(G, R, K, M, dev, g, bw, timer, copies_for), tp=tp))
            print(_fmt_o_a(o_a_rows[-1]), flush=True)
    return dict(
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        copy_bytes_per_s=bw,
        read_bytes_per_s=read_bw,
        checks=check_rows,
        rows=rows,
        o_a=o_a_rows,
    )


def _fmt(r: dict) -> str:
    us, f = r["us"], r["floor_us"]
    swept = {k: v for k, v in us.items() if k not in ("gemv", "gemm", "naive", "bf16 cuBLAS")}
    best = min(swept, key=swept.get) if swept else None
    best_s = f"{best} {swept[best]:.1f} ({swept[best] / f:.2f}x)" if best else "-"
    return (
        f"| {r['tp']} | {r['shape']} {r['N']} x {r['K']} | {r['M']} | {f:.1f} | **{us['gemv']:.1f} ({us['gemv'] / f:.2f}x)** | "
        f"{best_s} | {us['gemm']:.1f} ({us['gemm'] / f:.2f}x) | {r['launches']['gemv']} / {r['launches']['gemm']} | "
        f"{us['naive']:.1f} ({us['naive'] / f:.1f}x) | "
        f"{us['bf16 cuBLAS']:.1f} | {max(r['err'].values()):.1e} |"
    )


def _fmt_o_a(r: dict) -> str:
    us, n, f, f16 = r["us"], r["launches"], r["floor_us"], r["bf16_floor_us"]
    cells = [f"{us[k]:.1f} ({us[k] / (f16 if k.startswith('bf16') else f):.2f}x, {n[k]} launches)" for k in us]
    return f"| {r['tp']} | {r['shape']} | {r['M']} | {f:.1f} / {f16:.1f} | " + " | ".join(cells) + " |"


HEADER = (
    "| tp | shape (N x K) | M | floor us | GEMV us (x floor) | best sweep variant | GEMM us | launches GEMV / GEMM | "
    "torch naive us | bf16 cuBLAS us | max rel err |\n| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
)
O_A_HEADER = (
    "| tp | o_a | M | floor us fp8 / bf16 | fp8 grouped | fp8 per-group loop | bf16 grouped (one bmm) | "
    "bf16 einsum (before) | bf16 per-group loop |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--no-sweep", action="store_true", help="time only the default GEMV, the GEMM and baselines")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small dims, eager timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.tp = [1, 3], [1]
    print(HEADER, flush=True)
    report = run(args)
    print("\n" + HEADER + "\n" + "\n".join(_fmt(r) for r in report["rows"]))
    print("\n" + O_A_HEADER + "\n" + "\n".join(_fmt_o_a(r) for r in report["o_a"]))
    tol = 3e-2
    bad = [c for c in report["checks"] if c["nan"] or c["err"] > tol]
    bad += [r for r in report["rows"] + report["o_a"] if max(r["err"].values()) > tol]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemv.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(report['checks'])} checks, {len(report['rows']) + len(report['o_a'])} timed rows, {len(bad)} over "
          f"the error bound {tol}; wrote {args.out}/fp8_gemv.json")  # fmt: skip
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
