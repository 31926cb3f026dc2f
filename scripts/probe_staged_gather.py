"""Why the staged path's gather takes longer in a transfer benchmark than in a warm loop: the same
pdserve `gather()` (disagg/staging.py) of an 8K-token DeepSeek-V3 request (61 layers, 128 blocks
of 64 tokens x 576 bf16 values: 549 MiB), timed with CUDA events after different things.

    python scripts/probe_staged_gather.py [--json PATH]      (a CUDA device)

Back to back, behind other GPU work (matmuls, a 4 GB memset that thrashes L2 and the TLB), and
after the GPU idled 1-50 ms. On an H200 (2026-12-03) the kernel takes 0.32 ms queued behind other
work and 0.54-0.84 ms after an idle gap: the GPU's power state, not the copy or the host code
(docs/bench/staged_gather_idle_h200_2026-12-03.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.disagg.layout import KVLayout
from pdserve.disagg.staging import MIB, StagingArena, gather, slab_parts
from pdserve.model.kv_cache import KVCache, KVRegionSpec

LAYERS, POOL_BLOCKS, BLOCK_SIZE, DIM, REQUEST_BLOCKS = 61, 1024, 64, 576, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the medians here")
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args()
    dev = torch.device("cuda")
    kv = KVCache([KVRegionSpec("latent", DIM)], LAYERS, POOL_BLOCKS, BLOCK_SIZE, torch.bfloat16, "cuda")
    layout = KVLayout.from_kv_cache(kv)
    rng = random.Random(0)
    set_a = {"latent": sorted(rng.sample(range(POOL_BLOCKS), REQUEST_BLOCKS))}
    set_b = {"latent": sorted(rng.sample(range(POOL_BLOCKS), REQUEST_BLOCKS))}
    _, nbytes = slab_parts(layout, {"latent": REQUEST_BLOCKS})
    slab = StagingArena(nbytes + MIB, dev).slab(0, nbytes)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    big = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    out: dict[str, float] = {}

    def run(name: str, between, sets=(set_a,)) -> None:
        times = []
        for i in range(args.reps):
            between()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            gather(kv.regions, layout, sets[i % len(sets)], slab)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        out[name] = round(statistics.median(times[2:]), 3)  # the first two: allocator and clocks settle
        print(f"{name:44s} {out[name]:.3f} ms", flush=True)

    print(f"gather of {nbytes / MIB:.0f} MiB ({REQUEST_BLOCKS} blocks x {LAYERS} layers), CUDA-event ms, median of {args.reps - 2}")
    run("back to back, same blocks", lambda: None)
    run("back to back, two block sets alternating", lambda: None, (set_a, set_b))
    run("matmuls between (no sync, GPU never idle)", lambda: [a @ a for _ in range(10)])
    run("4 GB memset between (TLB/L2 thrash, busy)", lambda: big.fill_(1))
    for gap in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05):
        run(f"sleep {gap * 1e3:.0f} ms between", lambda g=gap: time.sleep(g))
    run("sleep 20 ms, then 1 ms of matmuls", lambda: (time.sleep(0.02), [a @ a for _ in range(5)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "MiB": round(nbytes / MIB, 1), "gather_ms": out}, f, indent=1)


if __name__ == "__main__":
    main()
