"""Host overhead of the kernel wrappers: one eager call at decode shapes (B=1) against the same
call replayed from a CUDA graph, and where the eager call's host time goes.

    python scripts/host_overhead.py [--out host_overhead.json] [--profile]

Per kernel and shape: `eager us` = wall time per call of 200 back-to-back calls (no sync
between, one at the end: when the host is slower than the kernel this is the host's time per
call), `graph us` = one replay of a graph of the same call (bench_util.graph_ms), the ratio
(issue 13's target: eager within 1.5x of replay), and with --profile the top functions of
cProfile over the eager calls (wrapper checks, planning, Triton's launcher). Needs a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import time

import torch

from pdserve_kernels import indexer_topk_paged, paged_mla_decode, sparse_mla_decode
from pdserve_kernels.bench_util import graph_ms
from pdserve_kernels.fused_moe import fused_moe


def cases(dev: torch.device) -> dict[str, callable]:
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    out = {}
    # V3.2 sparse decode: H=16 (TP8) and 128 (one GPU), top-2048 of a 4K pool
    kv = rnd(8192, 576)
    for H in (16, 128):
        q = rnd(1, 1, H, 576)
        idx = torch.randperm(8192, generator=g, device=dev)[:2048].to(torch.int32).view(1, 1, 2048)
        out[f"sparse_mla_decode V3.2 H={H} K=2048"] = lambda q=q, idx=idx: sparse_mla_decode(q, kv, idx, 0.1, 512)
    # V4 sparse decode: D = d_v = 512, sinks, window 128 + top-512
    kv4 = rnd(8192, 512)
    q4 = rnd(1, 1, 64, 512)
    idx4 = torch.randperm(8192, generator=g, device=dev)[:640].to(torch.int32).view(1, 1, 640)
    sink = rnd(64, dtype=torch.float32)
    out["sparse_mla_decode V4 H=64 K=640 sink"] = lambda: sparse_mla_decode(q4, kv4, idx4, 0.1, 512, sink=sink)
    # paged dense decode (V3), 4K context, 64-token pages
    tables = torch.randperm(128, generator=g, device=dev).to(torch.int32).view(1, 128)
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    qp = rnd(1, 1, 128, 576)
    out["paged_mla_decode V3 H=128 ctx=4096"] = lambda: paged_mla_decode(qp, kv, tables, seq, lens, 64, 4096, 0.1, 512)
    # paged indexer (V3.2): 64 heads of 128, top-2048 of 4K
    qi, ki, wi = rnd(1, 64, 128), rnd(8192, 128), rnd(1, 64, dtype=torch.float32)
    out["indexer_topk_paged V3.2 ctx=4096"] = lambda: indexer_topk_paged(qi, ki, wi, tables, seq, lens, 64, 4096, 2048)
    # fused MoE at V4-Flash's width, T=1, top-6 of 64 experts (a 4-layer bench's share)
    E, hidden, inter = 64, 4096, 2048
    w13, w2 = rnd(E, 2 * inter, hidden, scale=0.02), rnd(E, hidden, inter, scale=0.02)
    x = rnd(1, hidden)
    tw = torch.full((1, 6), 1 / 6, device=dev)
    ti = torch.randperm(E, generator=g, device=dev)[:6].view(1, 6)
    out["fused_moe V4-Flash T=1 top-6"] = lambda: fused_moe(x, w13, w2, tw, ti)
    return out


def eager_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_top(fn, calls: int = 200, top: int = 12) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip() and ln.strip()[0].isdigit()]
    return lines[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{'kernel':44} {'eager us':>9} {'graph us':>9} {'ratio':>6}")
    for name, fn in cases(dev).items():
        e = eager_us(fn)
        gr = graph_ms([fn]) * 1e3
        row = {"kernel": name, "eager_us": round(e, 1), "graph_us": round(gr, 1), "ratio": round(e / gr, 2)}
        print(f"{name:44} {e:9.1f} {gr:9.1f} {e / gr:6.2f}")
        if args.profile:
            row["profile"] = profile_top(fn)
            for ln in row["profile"]:
                print("   ", ln)
        rows.append(row)
    if args.out:
        env = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
