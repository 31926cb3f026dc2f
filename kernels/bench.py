"""Decode-kernel benchmark: `python -m pdserve_kernels.bench [--quick] [--sweep] [--out DIR]`.

Measures the two ceilings first (device-to-device copy bandwidth counting bytes read + written,
and an 8192^3 bf16 matmul rate), checks every kernel at tiny model dims, then for each shape
times the Triton kernel from CUDA-graph replays over rotated input sets (the headline number: no
launch overhead, no warm L2) and with `triton.testing.do_bench` ("eager"), the per-head baseline
(sparse MLA) and the torch reference with `do_bench`, checks each against the fp32 reference
(relative L2 error), and prints time, floor = max(bytes / bandwidth, flops / matmul rate) and
time / floor. `--sweep` also times every candidate tile config per shape. Writes bench.md and
bench.json to --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import time

import torch
from triton.testing import do_bench

from pdserve_kernels import configs, kv_fp8, ref, sparse_mla
from pdserve_kernels.baseline import sparse_mla_decode_per_head
from pdserve_kernels.fused_moe import fused_moe
from pdserve_kernels.indexer import indexer_topk
from pdserve_kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_fp8

C = configs.MLAConfig
MLA_SWEEP = [C(16, 32, 4, 3), C(16, 64, 4, 2), C(32, 32, 4, 2), C(64, 32, 8, 2), C(64, 64, 8, 2),
             C(64, 32, 16, 2), C(64, 64, 16, 2), C(128, 32, 16, 2), C(64, 16, 8, 4),
             C(32, 16, 4, 4)]
M = configs.MoEConfig
MOE_SWEEP = [M(16, 64, 128, 4, 4), M(16, 128, 128, 4, 3), M(16, 64, 256, 4, 3),
             M(16, 32, 64, 4, 6), M(16, 64, 128, 8, 4)]


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


@contextlib.contextmanager
def poisoned_empty():
    """Every torch.empty inside is filled with NaN (ints: a large sentinel), so an element a
    kernel fails to write shows up in the comparison."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 2**30 - 1)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


def ms(fn, rep: int = 60) -> float:
    return do_bench(fn, warmup=15, rep=rep, return_mode="median")


def graph_ms(calls, replays: int = 20) -> float:
    """Median time of one call, from CUDA-graph replays of `calls` (one per input set, so
    repeated runs do not hit a warm L2); no CPU launch overhead, as a decode step under graphs."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def kernel_profile(fn, label: str, top: int = 8) -> list[str]:
    """Per-kernel GPU time of fn (torch profiler, 5 calls), to see where a shape's time goes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [f"profile {label}: {e.key[:60]} {e.device_time_total / 5:.1f} us/call x{e.count // 5}"
            for e in evs]


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul flop/s)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src)) * 1e-3
    bw = 2 * src.numel() * 4 / t
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = ms(lambda: a @ b, rep=200) * 1e-3
    return bw, 2 * 8192**3 / t


def check_tiny(dev: str) -> list[str]:
    """Tiny model dims on the GPU: non-power-of-two D and d_v, sinks, padding, fp8, MoE, indexer."""
    lines = []
    g = torch.Generator(device=dev).manual_seed(1)
    for dt in (torch.bfloat16, torch.float16):
        B, S, H, D, dv, K, N = 3, 2, 4, 80, 64, 37, 500
        q = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
        kv = torch.randn(N, D + 16, device=dev, dtype=dt, generator=g)[:, :D]
        idx = torch.randint(0, N, (B, S, K), device=dev, dtype=torch.int32, generator=g)
        idx[0, 0, ::4] = -1
        idx[2, 1] = -1
        sink = torch.randn(H, device=dev, generator=g)
        for sk in (None, sink):
            with poisoned_empty():
                out, lse = sparse_mla_decode(q, kv, idx, D**-0.5, dv, sink=sk)
            r_out, r_lse = ref.sparse_mla_decode_ref(q.double(), kv.double(), idx, D**-0.5, dv,
                                                     sink=None if sk is None else sk.double())
            fin = torch.isfinite(r_lse)
            lse_ok = torch.equal(fin, torch.isfinite(lse)) and bool(
                ((lse.double() - r_lse.double())[fin].abs() < 2e-2).all())
            lines.append(f"tiny sparse_mla {dt} sink={sk is not None}: rel {rel_err(out, r_out):.2e}"
                         f" lse_ok {lse_ok} nan {bool(out.isnan().any())}")
    q = torch.randn(2, 1, 16, 576, device=dev, dtype=torch.bfloat16, generator=g)
    kvf = torch.randn(300, 576, device=dev, generator=g)
    rec = kv_fp8.pack_kv_fp8(kvf, 512)
    idx = torch.randint(0, 300, (2, 1, 100), device=dev, dtype=torch.int32, generator=g)
    idx[1, 0, 50:] = -1
    with poisoned_empty():
        out, lse = sparse_mla_decode_fp8(q, rec, idx, 576**-0.5, 512)
    r_out, _ = kv_fp8.sparse_mla_decode_fp8_ref(q.double(), rec, idx, 576**-0.5, 512)
    lines.append(f"fp8 sparse_mla 576/512: rel {rel_err(out, r_out):.2e}")
    T, E, k, hid, inter = 5, 8, 2, 128, 64
    x = torch.randn(T, hid, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(E, 2 * inter, hid, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    w2 = torch.randn(E, hid, inter, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E - 1, device=dev)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k, device=dev, generator=g)
    with poisoned_empty():
        y = fused_moe(x, w13, w2, tw, ids)
    r = ref.fused_moe_ref(x.double(), w13.double(), w2.double(), tw.double(), ids)
    lines.append(f"tiny fused_moe E=8 hidden=128 I=64 bf16: rel {rel_err(y, r):.2e}")
    qi = torch.randn(4, 8, 64, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(200, 64, device=dev, dtype=torch.bfloat16, generator=g)
    wi = torch.randn(4, 8, device=dev, generator=g)
    cand = torch.randint(0, 200, (4, 90), device=dev, dtype=torch.int32, generator=g)
    cand[3, 30:] = -1
    got = indexer_topk(qi, kc, wi, cand, 40)
    want_scores = torch.einsum("th,thc->tc", wi.double(), torch.relu(torch.einsum(
        "thd,tcd->thc", qi.double(), kc.double()[cand.clamp(min=0).long()])))
    want_scores = want_scores.masked_fill(cand < 0, float("-inf"))
    pos = {}
    ok = True
    for t in range(4):
        pos = {int(c): i for i, c in enumerate(cand[t].tolist()) if c >= 0}
        picked = [pos[int(c)] for c in got[t].tolist() if c >= 0]
        top = want_scores[t].topk(40).values
        ok &= torch.allclose(want_scores[t, picked].sort(descending=True).values,
                             top[torch.isfinite(top)], rtol=2e-2, atol=2e-2)
    lines.append(f"tiny indexer_topk bf16: scores match {ok}")
    return lines


def mla_rows(bw, peak, quick, sweep, fp8, prof):
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
    for name, H, B, D, dv, K, has_sink in shapes:
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
        idx_sets = [torch.randint(0, N, (B, 1, K), device=dev, dtype=torch.int32, generator=g)
                    for _ in range(sets)]
        cands = [("triton", None)] + ([(f"cfg{c}", c) for c in MLA_SWEEP] if sweep else [])
        for label, cfg in cands:
            fn = lambda c=cfg: sparse_mla_decode(q, kv, idx, scale, dv, sink=sink, config=c)
            calls = [lambda c=cfg, i=i: sparse_mla_decode(q, kv, i, scale, dv, sink=sink, config=c)
                     for i in idx_sets]
            try:
                with poisoned_empty():
                    out, _ = fn()
                info = sparse_mla.LAST_COMPILED.get("split")
                res = (f"regs {info.n_regs} spills {info.n_spills} smem {info.metadata.shared}"
                       if info is not None else "")
                rows.append(dict(kernel="sparse_mla", shape=f"{name} H={H} B={B} K={K}",
                                 impl=label, ms=graph_ms(calls), floor_ms=floor,
                                 rel_err=rel_err(out, r_out),
                                 note=f"eager {ms(fn) * 1e3:.0f} us; {res}"))
            except Exception as e:  # a sweep candidate may not compile (resources): report it
                print(f"{label} failed at {name} H={H} B={B}: {str(e)[:200]}", flush=True)
        if fp8 and name == "V3.2":
            fb = B * K * 656 + q.numel() * 2 + B * H * dv * 2
            f_floor = max(fb / bw, flops / peak) * 1e3
            fn = lambda: sparse_mla_decode_fp8(q, pool_fp8, idx, scale, dv, sink=sink)
            calls = [lambda i=i: sparse_mla_decode_fp8(q, pool_fp8, i, scale, dv, sink=sink)
                     for i in idx_sets]
            out, _ = fn()
            want = kv_fp8.sparse_mla_decode_fp8_ref(q.float(), pool_fp8, idx, scale, dv)[0]
            rows.append(dict(kernel="sparse_mla", shape=f"{name} H={H} B={B} K={K}",
                             impl="triton-fp8", ms=graph_ms(calls), floor_ms=f_floor,
                             rel_err=rel_err(out, want), note=f"eager {ms(fn) * 1e3:.0f} us"))
        if (H, B) in ((64, 64), (128, 64), (64, 1)):
            prof += kernel_profile(lambda: sparse_mla_decode(q, kv, idx, scale, dv, sink=sink),
                                   f"{name} H={H} B={B}")
        fn = lambda: sparse_mla_decode_per_head(q, kv, idx, scale, dv, sink=sink)
        rows.append(dict(kernel="sparse_mla", shape=f"{name} H={H} B={B} K={K}", impl="per-head",
                         ms=ms(fn, rep=40), floor_ms=floor, rel_err=rel_err(fn()[0], r_out),
                         note=""))
        fn = lambda: ref.sparse_mla_decode_ref(q, kv, idx, scale, dv, sink=sink)
        rows.append(dict(kernel="sparse_mla", shape=f"{name} H={H} B={B} K={K}", impl="torch-ref",
                         ms=ms(fn, rep=40), floor_ms=floor, rel_err=rel_err(ref_bf16, r_out),
                         note=""))
        torch.cuda.empty_cache()
    return rows


def moe_rows(bw, peak, quick, sweep, prof):
    rows = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    E, inter = 256, 2048
    for top_k, hidden in ((8, 7168), (6, 4096)):
        w13 = torch.randn(E, 2 * inter, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        w13 *= hidden**-0.5
        w2 = torch.randn(E, hidden, inter, device=dev, dtype=torch.bfloat16, generator=g)
        w2 *= inter**-0.5
        for T in ((1, 64) if quick else (1, 16, 64, 256)):
            x = torch.randn(T, hidden, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.rand(T, E, device=dev, generator=g).topk(top_k, dim=1).indices.int()
            tw = torch.softmax(torch.randn(T, top_k, device=dev, generator=g), -1)
            want = ref.fused_moe_ref(x, w13, w2, tw, ids).float()
            used = torch.unique(ids).numel()
            bytes_ = used * 3 * inter * hidden * 2 + 2 * T * hidden * 2
            flops = 2 * T * top_k * 3 * inter * hidden
            floor = max(bytes_ / bw, flops / peak) * 1e3
            shape = f"E={E} top{top_k} hidden={hidden} T={T} ({used} experts)"
            cands = [("triton", None)] + ([(f"cfg{c}", c) for c in MOE_SWEEP] if sweep else [])
            for label, cfg in cands:
                fn = lambda c=cfg: fused_moe(x, w13, w2, tw, ids, config=c)
                try:
                    with poisoned_empty():
                        out = fn()
                    rows.append(dict(kernel="fused_moe", shape=shape, impl=label,
                                     ms=graph_ms([fn], replays=10), floor_ms=floor,
                                     rel_err=rel_err(out, want), note=f"eager {ms(fn) * 1e3:.0f} us"))
                except Exception as e:  # see mla_rows
                    print(f"{label} failed at {shape}: {str(e)[:200]}", flush=True)
            if T in (1, 16):
                prof += kernel_profile(lambda: fused_moe(x, w13, w2, tw, ids), shape)
            fn = lambda: ref.fused_moe_ref(x, w13, w2, tw, ids)
            rows.append(dict(kernel="fused_moe", shape=shape, impl="torch-ref", ms=ms(fn, rep=30),
                             floor_ms=floor, rel_err=rel_err(fn(), want), note=""))
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| kernel | shape | impl | median us | floor us | x floor | rel err | note |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['ms'] * 1e3:.1f} | "
                     f"{r['floor_ms'] * 1e3:.1f} | {r['ms'] / r['floor_ms']:.2f} | "
                     f"{r['rel_err']:.1e} | {r['note']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate tile config")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-KV sparse MLA rows")
    ap.add_argument("--only", choices=["mla", "moe"], help="one kernel family")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA device")
    prop = torch.cuda.get_device_properties(0)
    head = (f"{prop.name}, {prop.multi_processor_count} SMs, cc {prop.major}.{prop.minor}, "
            f"torch {torch.__version__}, {datetime.date.today()}")
    print(head, flush=True)
    bw, peak = ceilings()
    head += f"\ncopy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {peak / 1e12:.0f} TFLOP/s"
    print(head, flush=True)
    checks = check_tiny("cuda")
    print("\n".join(checks), flush=True)
    t0 = time.time()
    rows, prof = [], []
    if args.only in (None, "mla"):
        rows += mla_rows(bw, peak, args.quick, args.sweep, not args.no_fp8, prof)
        print(table(rows), flush=True)
    if args.only in (None, "moe"):
        moe = moe_rows(bw, peak, args.quick, args.sweep, prof)
        print(table(moe), flush=True)
        rows += moe
    print("\n".join(prof), flush=True)
    text = f"{head}\n\n" + "\n".join(checks + prof) + f"\n\n{table(rows)}\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(head=head, checks=checks, rows=rows), f, indent=1)
    print(f"done in {time.time() - t0:.0f}s; wrote {args.out}/bench.md", flush=True)


if __name__ == "__main__":
    main()
