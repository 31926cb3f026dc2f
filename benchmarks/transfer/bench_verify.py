"""The verified hand-off's cost (pdserve/disagg/checksum.py) against the transfer it checks.

    python -m benchmarks.transfer.bench_verify [--device cuda:0] [--sizes 64,257,549] [--reps 20] [--link-gbps 50]

One bf16 region of 576-value records (DeepSeek's MLA latent), --layers layers, 64-token blocks; a
request of each size (MiB) holds the blocks of every layer. Timed, each the median of --reps,
synchronized, the Triton kernel (pdserve_kernels/kv_checksum.py, the default on a GPU) and the
torch path (the CPU's, and the GPU's before the kernel) in the same run:

    checksum   pool_checksums over the request's blocks: what prefill does at the lease and decode
               after the load lands, host sync included; `runs` (the blocks in 4 runs of consecutive
               ids) and `scattered` (every other block: the torch path gathers them, then sums)
    slab       slab_checksums over a gathered slab: prefill's checksum when the request is staged
    kernel GPU the kernel alone on the GPU (scattered ids): CUDA events around --reps launches
               queued back to back, per launch
    floor      the request's bytes read once at the device-copy bandwidth (read + write bytes of a
               --bw-mib MiB device copy per second): what a checksum that only reads cannot beat
    dev copy   one contiguous device copy of the request's bytes: the fastest transfer there is
    gather     staging.gather of the request's blocks into a slab (what staging costs, for scale)

and the kernel path against the floor (kernel GPU and end to end), the dev copy and a READ at
--link-gbps GB/s (a network link). The kernel columns are GPU-only ("-" on the CPU).
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
from pdserve.disagg.staging import gather, region_words, slab_parts  # noqa: E402
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


def copy_bandwidth(device: torch.device, mib: int, reps: int) -> float:
    """Bytes moved (read + write) per second by a contiguous device copy of mib MiB."""
    src = torch.empty(mib * MIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, reps)


def kernel_gpu(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of fn (queued work only, no sync inside), reps calls back to back between
    two CUDA events, after a warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


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
    out = {"MiB": nbytes / MIB, "bytes": nbytes, "blocks": n}
    paths = {"torch": False, "kernel": True} if device.type == "cuda" else {"torch": False}
    for ids in (in_runs, blocks):  # the kernel's numbers are the torch path's, bit for bit
        sums = {path: pool_checksums(kv.regions, layout, ids, kernel) for path, kernel in paths.items()}
        if len(set(map(str, sums.values()))) != 1:
            raise SystemExit(f"checksum paths disagree at {size_mib} MiB: {sums}")
    slab_sums = {path: slab_checksums(slab, layout, counts, kernel) for path, kernel in paths.items()}
    if len(set(map(str, [*slab_sums.values(), pool_checksums(kv.regions, layout, blocks, False)]))) != 1:
        raise SystemExit(f"slab checksums disagree at {size_mib} MiB: {slab_sums}, pool {sums}")
    for path, kernel in paths.items():
        out[f"{path} runs"] = timed(lambda: pool_checksums(kv.regions, layout, in_runs, kernel), device, reps)
        out[f"{path} scattered"] = timed(lambda: pool_checksums(kv.regions, layout, blocks, kernel), device, reps)
        out[f"{path} slab"] = timed(lambda: slab_checksums(slab, layout, counts, kernel), device, reps)
    if device.type == "cuda":
        from pdserve_kernels.kv_checksum import checksum_blocks

        r = layout.regions[0]
        words = region_words(kv.regions[r.name], r.block_bytes)
        ids = torch.tensor(blocks["latent"], dtype=torch.int64, device=device)
        acc = torch.zeros(1, dtype=torch.int64, device=device)
        out["kernel GPU"] = kernel_gpu(lambda: checksum_blocks(words, ids, acc), device, reps)
    out["dev copy"] = timed(lambda: dst.copy_(slab), device, reps)
    out["gather"] = timed(lambda: gather(kv.regions, layout, blocks, slab), device, reps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="64,257,549", help="request sizes in MiB (V3 at 64 tokens a block: 4.3 MiB)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--link-gbps", type=float, default=50.0, help="a network READ's rate, GB/s, for the READ columns")
    p.add_argument(
        "--bw-mib", type=int, default=1024, help="size of the device copy the floor's bandwidth is measured on"
    )
    args = p.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    bw = copy_bandwidth(device, args.bw_mib, args.reps)
    print(f"device {name}, {args.layers} layers, bf16 576-value records, 64-token blocks, median of {args.reps}")
    print(
        f"device copy bandwidth {bw / 1e9:.0f} GB/s (read + write bytes, {args.bw_mib} MiB copy); READ {args.link_gbps:g} GB/s"
    )
    print("| MiB | blocks | floor ms | kernel GPU ms | kernel ms: runs | scattered | slab | torch ms: runs | scattered "
          "| slab | dev copy ms | gather ms | kernel GPU / floor | kernel runs / floor | kernel runs / dev copy "
          "| kernel runs / READ | kernel scattered / READ | torch runs / READ | torch scattered / READ |")  # fmt: skip
    print("| ---: " * 19 + "|")
    ms = lambda r, k: f"{r[k] * 1e3:.3f}" if k in r else "-"  # noqa: E731
    share = lambda r, k, t: f"{r[k] / t:.1%}" if k in r else "-"  # noqa: E731
    times = lambda r, k, t: f"{r[k] / t:.2f}x" if k in r else "-"  # noqa: E731
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.layers, device, args.reps)
        read_s = r["bytes"] / (args.link_gbps * 1e9)
        floor = r["bytes"] / bw
        cells = [f"{r['MiB']:.0f}", str(r["blocks"]), f"{floor * 1e3:.3f}", ms(r, "kernel GPU")]
        cells += [ms(r, f"{p} {k}") for p in ("kernel", "torch") for k in ("runs", "scattered", "slab")]
        cells += [ms(r, "dev copy"), ms(r, "gather")]
        cells += [times(r, "kernel GPU", floor), times(r, "kernel runs", floor), share(r, "kernel runs", r["dev copy"])]
        cells += [share(r, k, read_s) for k in ("kernel runs", "kernel scattered", "torch runs", "torch scattered")]
        print("| " + " | ".join(cells) + " |")
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
