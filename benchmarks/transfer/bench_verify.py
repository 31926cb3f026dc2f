"""The verified hand-off's cost (pdserve/disagg/checksum.py) against the transfer it checks.

    python -m benchmarks.transfer.bench_verify [--device cuda:0] [--sizes 64,257,549] [--reps 20] [--link-gbps 50]

One bf16 region of 576-value records (DeepSeek's MLA latent), --layers layers, 64-token blocks; a
request of each size (MiB) holds the blocks of every layer. Timed, each the median of --reps,
synchronized:

    checksum   pool_checksums over the request's blocks: what prefill does at the lease and decode
               after the load lands, host sync included; `runs` (the blocks in 4 runs of consecutive
               ids: summed in place) and `scattered` (every other block: gathered, then summed)
    slab sum   slab_checksums over a gathered slab: prefill's checksum when the request is staged
    dev copy   one contiguous device copy of the same bytes: the fastest transfer there is
    gather     staging.gather of the request's blocks into a slab (what staging costs, for scale)

and the checksum as a share of the dev copy and of a READ at --link-gbps GB/s (a network link).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from pdserve.disagg.checksum import pool_checksums, slab_checksums  # noqa: E402
from pdserve.disagg.layout import KVLayout  # noqa: E402
from pdserve.disagg.staging import gather, slab_parts  # noqa: E402
from pdserve.model.kv_cache import KVCache, KVRegionSpec  # noqa: E402

MIB = 1 << 20


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps, after one warm-up, each synchronized."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(size_mib: int, layers: int, device: torch.device, reps: int) -> dict:
    block_bytes = 64 * 576 * 2 * layers  # one block of every layer
    n = max(1, round(size_mib * MIB / block_bytes))
    kv = KVCache([KVRegionSpec("latent", 576)], layers, 2 * n + 1, 64, torch.bfloat16, device)
    kv.regions["latent"].normal_()
    layout = KVLayout.from_kv_cache(kv)
    blocks = {"latent": list(range(1, 2 * n + 1, 2))}
    quarter = -(-n // 4)
    in_runs = {"latent": [b for k in range(4) for b in range(k * 2 * quarter, k * 2 * quarter + quarter)][:n]}
    counts = {"latent": n}
    nbytes = n * block_bytes
    slab = torch.empty(slab_parts(layout, counts)[1], dtype=torch.uint8, device=device)
    gather(kv.regions, layout, blocks, slab)
    dst = torch.empty_like(slab)
    return {
        "MiB": nbytes / MIB,
        "blocks": n,
        "runs": timed(lambda: pool_checksums(kv.regions, layout, in_runs), device, reps),
        "scattered": timed(lambda: pool_checksums(kv.regions, layout, blocks), device, reps),
        "slab sum": timed(lambda: slab_checksums(slab, layout, counts), device, reps),
        "dev copy": timed(lambda: dst.copy_(slab), device, reps),
        "gather": timed(lambda: gather(kv.regions, layout, blocks, slab), device, reps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="64,257,549", help="request sizes in MiB (V3 at 64 tokens a block: 4.3 MiB)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--link-gbps", type=float, default=50.0, help="a network READ's rate, GB/s, for the last column")
    args = p.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {name}, {args.layers} layers, bf16 576-value records, 64-token blocks, median of {args.reps}")
    cols = "| MiB | blocks | checksum ms: runs | scattered | slab sum ms | dev copy ms | gather ms |"
    print(cols + " runs / dev copy | runs / READ | scattered / READ |")
    print("| ---: " * 10 + "|")
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.layers, device, args.reps)
        read_s = r["MiB"] * MIB / (args.link_gbps * 1e9)
        cells = [f"{r['MiB']:.0f}", str(r["blocks"])]
        cells += [f"{r[k] * 1e3:.3f}" for k in ("runs", "scattered", "slab sum", "dev copy", "gather")]
        cells += [f"{r['runs'] / r['dev copy']:.0%}", f"{r['runs'] / read_s:.1%}", f"{r['scattered'] / read_s:.1%}"]
        print("| " + " | ".join(cells) + " |")
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
