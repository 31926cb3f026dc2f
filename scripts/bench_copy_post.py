"""What posting a same-host KV copy costs, and the copy start to done, on one GPU.

    python scripts/bench_copy_post.py [--sizes 64,257,549] [--configs 512x8x4,2048x16x8] [--json out.json]

A decode worker posts a request's copy (disagg/cuda_ipc.py: CopyQueue.start) when its hand-off
arrives, usually on a machine that was idle a moment before: so each post here follows 2 ms of
host sleep with the GPU idle (`idle`) or kept busy by one spinning block on another stream
(`gpu-awake`: the GPU's clocks up, its bandwidth free), or follows 2 ms of the host spinning
(`cpu-busy`: a worker in the middle of its loop, its core awake). Variants: `upload` is how
2026-12-04's code posted (the side stream made current, the ids uploaded from a list, Triton's launcher, an
event), `ring` is CopyQueue.start (ids in a pinned ring the kernel reads by address, the kernel
bound once per peer launched on the side stream), at each --configs tile (BW words x LG layers x
warps). Floor: one
contiguous copy_ of the request's bytes (CUDA events, warm). Times: host perf_counter, median of
30 posts; `done` polls the copy's event. Every variant's bytes are checked first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pdserve_kernels.block_copy as bc  # noqa: E402
from pdserve.disagg.cuda_ipc import CopyQueue  # noqa: E402
from pdserve_kernels.ref import copy_blocks_ref  # noqa: E402

LAYERS, WORDS, MIB = 61, 64 * 576 * 2 // 8, 1 << 20  # V3: 72 KiB blocks as int64 words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,257,549", help="request sizes in MiB")
    p.add_argument("--configs", default=f"{bc.BLOCK_WORDS}x{bc.LAYER_GROUP}x{bc.NUM_WARPS}", help="BWxLGxwarps list for `ring`")
    p.add_argument("--posts", type=int, default=30)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    queue, side = CopyQueue(dev), torch.cuda.Stream(dev, priority=-1)
    awake = torch.cuda.Stream(dev)
    spin_cycles = int(torch.cuda.get_device_properties(dev).clock_rate * 1e3 * 0.004)  # ~4 ms

    def upload(views, src_ids, dst_ids):
        with torch.cuda.stream(side):
            for name, (s, d) in views.items():
                bc.copy_blocks(s, d, torch.tensor(src_ids[name], device=dev), torch.tensor(dst_ids[name], device=dev))
            event = torch.cuda.Event()
            event.record(side)
        return event

    def ring(cfg):
        bound = {}  # per request size: the views bound at this tile (CopyQueue.bind, once per peer in a worker)

        def post(views, src_ids, dst_ids):
            if id(views) not in bound:
                saved = bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS
                bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS = cfg
                bound[id(views)] = views, queue.bind(views)
                bc.BLOCK_WORDS, bc.LAYER_GROUP, bc.NUM_WARPS = saved
            return queue.start(bound[id(views)][1], src_ids, dst_ids).event
        return post

    variants = {"upload": upload}
    for c in args.configs.split(","):
        variants[f"ring {c}"] = ring(tuple(int(x) for x in c.split("x")))
    rows = []
    for mib in (float(x) for x in args.sizes.split(",")):
        n = max(1, round(mib * MIB / (LAYERS * WORDS * 8)))
        pool = 2 * n + 4
        src = torch.randint(-(1 << 62), 1 << 62, (LAYERS, pool, WORDS), dtype=torch.int64, device=dev)
        dst = torch.zeros(LAYERS, pool, WORDS, dtype=torch.int64, device=dev)
        rng = random.Random(n)
        ids = ({"kv": rng.sample(range(pool), n)}, {"kv": rng.sample(range(pool), n)})
        views = {"kv": (src, dst)}
        want = dst.clone()
        copy_blocks_ref(src, want, torch.tensor(ids[0]["kv"]), torch.tensor(ids[1]["kv"]))
        flat = LAYERS * n * WORDS
        fs, fd = src.view(-1)[:flat], dst.view(-1)[:flat]
        for _ in range(5):
            fd.copy_(fs)
        start, end, ts = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for _ in range(20):
            start.record()
            fd.copy_(fs)
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        floor = statistics.median(ts)
        for name, post in variants.items():
            dst.zero_()
            torch.cuda.synchronize()
            post(views, *ids).synchronize()
            if not torch.equal(dst, want):
                raise SystemExit(f"{name} at {mib} MiB: wrong bytes")
            for _ in range(3):
                post(views, *ids).synchronize()
            for cond in ("idle", "gpu-awake", "cpu-busy"):
                posted, done = [], []
                for _ in range(args.posts):
                    torch.cuda.synchronize()
                    if cond == "gpu-awake":
                        with torch.cuda.stream(awake):
                            torch.cuda._sleep(spin_cycles)
                    if cond == "cpu-busy":
                        until = time.perf_counter() + 0.002
                        while time.perf_counter() < until:
                            pass
                    else:
                        time.sleep(0.002)
                    t0 = time.perf_counter()
                    event = post(views, *ids)
                    t1 = time.perf_counter()
                    while not event.query():
                        pass
                    posted.append(t1 - t0)
                    done.append(time.perf_counter() - t0)
                rows.append(dict(mib=flat * 8 / MIB, blocks=n, variant=name, cond=cond, post_s=statistics.median(posted),
                                 done_s=statistics.median(done), floor_s=floor))
    print(f"{torch.cuda.get_device_name(dev)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; floor: one contiguous copy_")
    print(f"{'MiB':>6} {'variant':<20} {'cond':<9} {'post ms':>8} {'done ms':>8} {'floor ms':>8} {'floor/done':>10}")
    for r in rows:
        print(f"{r['mib']:6.0f} {r['variant']:<20} {r['cond']:<9} {r['post_s'] * 1e3:8.3f} {r['done_s'] * 1e3:8.3f} "
              f"{r['floor_s'] * 1e3:8.3f} {r['floor_s'] / r['done_s']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
