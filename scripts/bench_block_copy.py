"""Staged transfer's gather / scatter on a GPU: torch's index_select / index_copy_ (what staging.py
used) against kernels/block_copy.py, and one contiguous copy of the same bytes (the ceiling).

    python scripts/bench_block_copy.py [--json PATH]

Shapes of a real request's KV (DeepSeek-V3 latent, 64-token blocks of 576 bf16 values = 73,728 B,
as int64 words): an 8K-token request over 61 layers (549 MiB) and a 1K-token one over the README's
4-layer model (4.7 MB), block ids drawn at random from a 1,024-block pool. Every variant is checked
against index_select / index_copy_ first. Times: triton.testing.do_bench medians.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from pdserve_kernels import block_copy

WORDS = 73_728 // 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    args = p.parse_args()
    dev = "cuda"
    rows = []
    for name, layers, n in (("8K tokens, 61 layers", 61, 128), ("1K tokens, 4 layers", 4, 16)):
        pool = torch.randint(-(2**62), 2**62, (layers, 1024, WORDS), dtype=torch.int64, device=dev)
        ids = torch.randperm(1024, device=dev)[:n]
        slab = torch.empty(layers, n, WORDS, dtype=torch.int64, device=dev)
        want = torch.index_select(pool, 1, ids)
        nbytes = want.numel() * 8
        flat_src, flat_dst = want.view(-1).clone(), torch.empty_like(want.view(-1))
        row = {"case": name, "mib": nbytes / 2**20, "copy_ms": triton.testing.do_bench(lambda: flat_dst.copy_(flat_src))}
        row["index_select_ms"] = triton.testing.do_bench(lambda: torch.index_select(pool, 1, ids, out=slab))
        dst = pool.clone()
        row["index_copy_ms"] = triton.testing.do_bench(lambda: dst.index_copy_(1, ids, want))
        for b in (1024, 2048, 4096):
            block_copy.BLOCK = b
            slab.fill_(-1)
            block_copy.gather_blocks(pool, ids, slab)
            assert torch.equal(slab, want), "gather"
            dst2 = torch.zeros_like(pool)
            block_copy.scatter_blocks(want, ids, dst2)
            assert torch.equal(dst2[:, ids], want) and int(dst2.count_nonzero()) == int(want.count_nonzero()), "scatter"
            row[f"triton_gather_ms_{b}"] = triton.testing.do_bench(lambda: block_copy.gather_blocks(pool, ids, slab))
            row[f"triton_scatter_ms_{b}"] = triton.testing.do_bench(lambda: block_copy.scatter_blocks(want, ids, dst))
        rows.append(row)
        del pool, slab, dst, dst2, want, flat_src, flat_dst
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ms (x one contiguous copy of the same bytes)")
    for r in rows:
        c = r["copy_ms"]
        print(f"{r['case']} ({r['mib']:.1f} MiB): copy {c:.3f} | index_select {r['index_select_ms']:.3f} ({r['index_select_ms'] / c:.2f}x) | "
              f"index_copy_ {r['index_copy_ms']:.3f} ({r['index_copy_ms'] / c:.2f}x)")
        for b in (1024, 2048, 4096):
            g, s = r[f"triton_gather_ms_{b}"], r[f"triton_scatter_ms_{b}"]
            print(f"    triton BLOCK={b}: gather {g:.3f} ({g / c:.2f}x) scatter {s:.3f} ({s / c:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
