"""NIXL READ rate between two processes against a torch copy inside one, for a few request sizes.

    python scripts/bench_transfer.py [--sizes 1,16,64,256] [--reps 5] [--device cpu] [--peer-device cuda:1]

This process is the decode worker; it starts itself again with --peer as the prefill worker (its own
NIXL agent, metadata over HTTP on a free port). Both pools have one bf16 region of 576-value
records (DeepSeek's MLA latent), `--layers` layers, 64-token blocks. Each size is read twice:
`contiguous` (blocks 0..n-1 into 0..n-1: one descriptor per layer) and `scattered` (even blocks
into odd ones: one descriptor per block per layer). Every read is checked byte-exact once.
With --peer-device (e.g. --device cuda:0 --peer-device cuda:1) the prefill peer's pool is on that
device: NIXL reads VRAM to VRAM across GPUs, and the reference copy is a peer-to-peer copy_.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.disagg.base import KVHandle, PeerMetadata, TransferError  # noqa: E402
from pdserve.disagg.layout import block_runs  # noqa: E402
from pdserve.model.kv_cache import KVCache, KVRegionSpec  # noqa: E402

BLOCK_SIZE, DIM, DTYPE = 64, 576, torch.bfloat16
MIB = 1 << 20


def make_pool(num_layers: int, num_blocks: int, device: str, seed: int | None) -> KVCache:
    kv = KVCache([KVRegionSpec("latent", DIM)], num_layers, num_blocks, BLOCK_SIZE, DTYPE, device)
    if seed is not None:  # random bit patterns (NaNs included: the comparison is on bytes)
        gen = torch.Generator().manual_seed(seed)
        t = kv.regions["latent"]
        t.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, t.shape, generator=gen, dtype=torch.int16))
    return kv


def block_bytes(num_layers: int) -> int:
    """One block over all layers."""
    return num_layers * BLOCK_SIZE * DIM * torch.empty((), dtype=DTYPE).element_size()


def run_peer(args: argparse.Namespace) -> None:
    replies, sys.stdout = sys.stdout, sys.stderr  # nixl logs to stdout
    from pdserve.disagg.nixl_connector import NixlConnector

    conn = NixlConnector("bench-prefill", model_id="bench")
    conn.register_kv_cache(make_pool(args.layers, args.num_blocks, args.device, seed=0))
    body = conn.peer_metadata()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    replies.write(f"http://127.0.0.1:{server.server_address[1]}/metadata\n")
    replies.flush()
    sys.stdin.read()  # until the decode side closes our stdin
    conn.shutdown()
    server.shutdown()


def timed_read(conn, handle: KVHandle, dst_ids: list[int]) -> float:
    t0 = time.perf_counter()
    conn.start_load(handle, dst_ids, PEER.get(handle.metadata_url))
    while True:
        done, failed = conn.poll_loads()
        if failed:
            raise failed[0]
        if done:
            return time.perf_counter() - t0


def timed_copy(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> float:
    """The same runs NIXL reads, copied with one copy_ each (dst, src: [L, N, bs, dim])."""
    t0 = time.perf_counter()
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[:, d : d + n].copy_(src[:, s : s + n])
    for t in (dst, src):
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
    return time.perf_counter() - t0


PEER: dict[str, PeerMetadata] = {}  # metadata URL -> the peer's metadata, fetched once (as a decode worker does)


def handle_for(url: str, request_id: str, block_ids: list[int], compat: str) -> KVHandle:
    # the bench's peer holds no leases: its pool is static, so the handle is made here
    if url not in PEER:
        body = httpx.get(url, timeout=10).content
        info = json.loads(body)
        PEER[url] = PeerMetadata(engine_id=info["engine_id"], instance_id=info["instance_id"], data=body)
    return KVHandle(
        request_id=request_id,
        engine_id="bench-prefill",
        instance_id=PEER[url].instance_id,
        metadata_url=url,
        block_ids=block_ids,
        num_tokens=len(block_ids) * BLOCK_SIZE,
        compat_hash=compat,
        lease_expires_at=time.time() + 3600,
    )


def measure(conn, url: str, src: torch.Tensor, src_ids: list[int], dst_ids: list[int], reps: int, name: str):
    """(NIXL read seconds, copy seconds) of every rep for one request shape."""
    dst = conn.kv.regions["latent"]
    read_s, copy_s = [], []
    for rep in range(reps):
        dst.zero_()
        read_s.append(timed_read(conn, handle_for(url, f"{name}-{rep}", src_ids, conn.compat_hash), dst_ids))
        if rep == 0 and not torch.equal(dst[:, dst_ids].view(torch.int16), src[:, src_ids].to(dst.device).view(torch.int16)):
            raise SystemExit(f"NIXL READ {name} is not byte-exact")
        copy_s.append(timed_copy(dst, src, src_ids, dst_ids))
    return read_s, copy_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,64,256", help="request sizes in MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--peer-device", help="the prefill peer's device (default: --device)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the in-process copy (cma reads use one)")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    per_block = block_bytes(args.layers)
    counts = [max(1, round(float(s) * MIB / per_block)) for s in args.sizes.split(",")]
    if args.peer:
        return run_peer(args)
    args.num_blocks = 2 * max(counts)
    torch.set_num_threads(args.threads)

    from pdserve.disagg.nixl_connector import NixlConnector

    cmd = [sys.executable, os.path.abspath(__file__), "--peer", "--layers", str(args.layers)]
    peer_device = args.peer_device or args.device
    cmd += ["--device", peer_device, "--num-blocks", str(args.num_blocks), "--sizes", args.sizes]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = []
    try:
        url = peer.stdout.readline().strip()
        if not url:
            raise SystemExit(f"the prefill peer exited with {peer.wait()}")
        sys.stdout, console = sys.stderr, sys.stdout  # nixl logs to stdout; keep it for the table
        conn = NixlConnector("bench-decode", model_id="bench", transfer_timeout_s=120.0)
        conn.register_kv_cache(make_pool(args.layers, args.num_blocks, args.device, seed=None))
        src = make_pool(args.layers, args.num_blocks, peer_device, seed=0).regions["latent"]
        timed_read(conn, handle_for(url, "warm-up", [0], conn.compat_hash), [0])  # connection setup
        for n in counts:
            shapes = {
                "contiguous": (list(range(n)), list(range(n))),
                "scattered": (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))),
            }
            for kind, (src_ids, dst_ids) in shapes.items():
                read_s, copy_s = measure(conn, url, src, src_ids, dst_ids, args.reps, f"{kind}-{n}")
                descs = len(block_runs(src_ids, dst_ids)) * args.layers
                rows.append((n * per_block, n, kind, descs, read_s, copy_s))
        conn.shutdown()
    except TransferError as e:
        raise SystemExit(str(e)) from e
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)
    sys.stdout = console
    print_table(rows, args)


def print_table(rows: list[tuple], args: argparse.Namespace) -> None:
    where = args.device if not args.peer_device else f"{args.device} (read from {args.peer_device})"
    print(f"KV pool: 1 bf16 region, {args.layers} layers, {BLOCK_SIZE}-token blocks of {DIM} values on {where}")
    print(f"GB/s: median (best) of {args.reps} reps; NIXL: start_load..poll_loads done, between two processes;")
    print(f"copy: the same runs with torch copy_ in one process, {args.threads} thread(s)")
    print(f"{'MiB':>7} {'blocks':>6} {'layout':>10} {'descs':>6} {'NIXL GB/s':>14} {'copy GB/s':>14} {'NIXL/copy':>9}")
    for nbytes, n, kind, descs, read_s, copy_s in rows:
        nixl, copy = nbytes / statistics.median(read_s) / 1e9, nbytes / statistics.median(copy_s) / 1e9
        nixl_best, copy_best = nbytes / min(read_s) / 1e9, nbytes / min(copy_s) / 1e9
        cols = f"{nixl:6.2f} ({nixl_best:5.2f}) {copy:6.2f} ({copy_best:5.2f}) {nixl / copy:9.2f}"
        print(f"{nbytes / MIB:7.1f} {n:6d} {kind:>10} {descs:6d} {cols}")


if __name__ == "__main__":
    main()
