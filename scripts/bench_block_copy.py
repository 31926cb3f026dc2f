"""The same-host KV copy (kernels/block_copy.py) against the library ways of moving a request's
blocks between two pools, on one GPU, for a DeepSeek-V3 region (61 layers, 64-token blocks of
576 bf16 values: 72 KiB a block a layer).

    python scripts/bench_block_copy.py [--sizes 64,549] [--json out.json]

Floor: the request's bytes read and written once over the device's copy rate, measured here as
one contiguous copy_ of the same bytes (`contiguous`). Variants, for a real request's block list
(runs of mean length 2 on both sides, as scripts/bench_transfer.py's `request`) and a scattered
one (every other block): copy_blocks at a few tile sizes and layer groups, with its ids on the
device and (as the same-host copy passes them) in pinned host memory; index_select into a
temporary then index_copy_ (two passes); one copy_ per run of blocks consecutive on both sides. Times are
triton.testing.do_bench medians; every variant is checked against the reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pdserve_kernels.block_copy as bc  # noqa: E402
from pdserve.disagg.layout import block_runs  # noqa: E402
from pdserve_kernels.ref import copy_blocks_ref  # noqa: E402

LAYERS, BLOCK_BYTES, MIB = 61, 64 * 576 * 2, 1 << 20


def request_ids(n: int, pool: int, mean_run: float, seed: int) -> list[int]:
    """n block ids as a busy block manager hands them out: runs of geometric length, shuffled."""
    rng = random.Random(seed)
    runs, b = [], 0
    while b < pool:
        k = 1
        while rng.random() > 1 / mean_run and b + k < pool:
            k += 1
        runs.append(list(range(b, min(b + k, pool))))
        b += k
    rng.shuffle(runs)
    return [x for r in runs for x in r][:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,549", help="request sizes in MiB")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    dev = torch.device("cuda")
    words = BLOCK_BYTES // 8
    rows = []
    for mib in (float(x) for x in args.sizes.split(",")):
        n = max(1, round(mib * MIB / (LAYERS * BLOCK_BYTES)))
        pool = 2 * n + 2
        src = torch.randint(-(1 << 62), 1 << 62, (LAYERS, pool, words), dtype=torch.int64, device=dev)
        dst = torch.zeros(LAYERS, pool, words, dtype=torch.int64, device=dev)
        nbytes = LAYERS * n * BLOCK_BYTES
        flat_src, flat_dst = src.view(-1)[: nbytes // 8], dst.view(-1)[: nbytes // 8]
        floor = triton.testing.do_bench(lambda: flat_dst.copy_(flat_src), warmup=50, rep=300) / 1e3
        rows.append(dict(mib=nbytes / MIB, blocks=n, kind="-", variant="contiguous copy_ (floor)", s=floor, floor_s=floor))
        lists = {"request": (request_ids(n, pool, 4.0, 1), request_ids(n, pool, 4.0, 2)),
                 "scattered": (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2)))}
        for kind, (s_ids, d_ids) in lists.items():
            si, di = torch.tensor(s_ids, device=dev), torch.tensor(d_ids, device=dev)
            hs, hd = si.cpu().pin_memory(), di.cpu().pin_memory()
            runs = block_runs(s_ids, d_ids)
            dst.zero_()  # (the floor's copy_ wrote into it)
            want = dst.clone()
            copy_blocks_ref(src, want, si, di)
            variants = {}
            default = (bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS)
            for bw, lg, warps, host in ((512, 1, 4, False), (512, 4, 4, False), (512, 8, 4, False), (512, 16, 4, False),
                                        (1024, 8, 4, False), (2048, 8, 8, False), (4096, 16, 8, False), (512, 8, 4, True), (512, 1, 4, True),
                                        # host ids: every program's two reads cross PCIe, so fewer, larger programs
                                        (1024, 16, 4, True), (2048, 8, 8, True), (2048, 16, 8, True), (2048, 32, 8, True),
                                        (4096, 16, 8, True)):
                def kernel(bw=bw, lg=lg, warps=warps, host=host):
                    bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS = bw, lg, warps
                    bc.copy_blocks(src, dst, hs if host else si, hd if host else di)
                tag = " (default)" if (bw, lg, warps) == default else ""
                variants[f"copy_blocks BW {bw} LG {lg} warps {warps}{', host ids' if host else ''}{tag}"] = kernel

            def two_pass():
                dst.index_copy_(1, di, src.index_select(1, si))

            def per_run():
                for s, d, k in runs:
                    dst[:, d : d + k].copy_(src[:, s : s + k])

            variants["index_select + index_copy_ (two passes)"] = two_pass
            variants[f"copy_ per run ({len(runs)} launches)"] = per_run
            for name, fn in variants.items():
                dst.zero_()
                fn()
                torch.cuda.synchronize()
                if not torch.equal(dst, want):
                    raise SystemExit(f"{name} {kind}: wrong bytes")
                t = triton.testing.do_bench(fn, warmup=50, rep=300) / 1e3
                rows.append(dict(mib=nbytes / MIB, blocks=n, kind=kind, variant=name, s=t, floor_s=floor))
            bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS = default
        del src, dst
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name(0)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; GB/s counts the request's bytes once")
    print(f"{'MiB':>6} {'list':>9} {'variant':<56} {'ms':>7} {'GB/s':>7} {'x floor':>7}")
    for r in rows:
        print(f"{r['mib']:6.0f} {r['kind']:>9} {r['variant']:<56} {r['s'] * 1e3:7.3f} {r['mib'] * MIB / r['s'] / 1e9:7.0f} {r['s'] / r['floor_s']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
