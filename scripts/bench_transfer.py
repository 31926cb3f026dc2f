"""NIXL READ rate between two processes against a torch copy inside one, for a few request sizes.

    python scripts/bench_transfer.py [--sizes 1,16,64,256] [--reps 5] [--device cpu] [--peer-device cuda:1]
    python scripts/bench_transfer.py --device cuda:0 --settings default,zcopy,zcopy+moddir,pdserve \
        --layers 61 --sizes 64,549 --layouts layer,block --json out.json

This process is the decode worker; it starts itself again with --peer as the prefill worker (its own
NIXL agent, metadata over HTTP on a free port). Both pools have one bf16 region of 576-value
records (DeepSeek's MLA latent), `--layers` layers, 64-token blocks. Each size is read three ways:
`contiguous` (blocks 0..n-1 into 0..n-1: one descriptor per layer), `request` (block lists as a
busy block manager hands them out: both pools cut into runs of geometric length, mean
--mean-run, shuffled; a descriptor per run consecutive on both sides per layer) and `scattered`
(even blocks into odd ones: one descriptor per block per layer). Every read is checked
byte-exact once.

--layouts: `layer` is pdserve's pool (KVCache: [L, N, bs, dim], a descriptor per (layer, run));
`block` emulates a block-major pool ([N, L, bs, dim]: one block of all layers contiguous, a
descriptor per run) as a one-layer pool of L*bs-token blocks: the same bytes per block.
--settings runs the whole measurement once per UCX setting, each in fresh processes (UCX reads
its variables once): `default` (no UCX variables), `zcopy` (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y),
`zcopy+moddir` (and UCX_MODULE_DIR = the NIXL wheel's UCX folder), `pdserve` (none set by hand:
the connector's own GPU defaults); `default` runs the first size only, 2 reps (UCX uses tcp there). `dev copy` is one contiguous device copy of the same bytes.
With --peer-device (e.g. --device cuda:0 --peer-device cuda:1) the prefill peer's pool is on that
device: NIXL reads VRAM to VRAM across GPUs, and the reference copy is a peer-to-peer copy_.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
SETTINGS = {  # UCX variables set by hand for each --settings entry (the module dir: found at run time)
    "default": {},
    "zcopy": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
    "zcopy+moddir": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_MODULE_DIR": None},
    "pdserve": {},
}


def make_pool(num_layers: int, num_blocks: int, device: str, seed: int | None, layout: str = "layer") -> KVCache:
    """layout "block": [N, L, bs, dim] seen as one layer of L*bs-token blocks (same bytes per block)."""
    if layout == "block":
        num_layers, block_size = 1, BLOCK_SIZE * num_layers
    else:
        block_size = BLOCK_SIZE
    kv = KVCache([KVRegionSpec("latent", DIM)], num_layers, num_blocks, block_size, DTYPE, device)
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

    conn = NixlConnector("bench-prefill", model_id="bench", ucx_gpu_defaults=args.setting == "pdserve")
    conn.register_kv_cache(make_pool(args.layers, args.num_blocks, args.device, seed=0, layout=args.layout))
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
    replies.write(f"URL http://127.0.0.1:{server.server_address[1]}/metadata\n")  # UCX may print to fd 1 too
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


def request_ids(n: int, num_blocks: int, mean_run: float, seed: int) -> list[int]:
    """n block ids as a busy pool hands them out: the pool cut into runs of geometric length
    (mean `mean_run`), the runs shuffled, the first n ids taken."""
    rng = random.Random(seed)
    runs, b = [], 0
    while b < num_blocks:
        length = 1
        while rng.random() > 1 / mean_run:
            length += 1
        runs.append(list(range(b, min(b + length, num_blocks))))
        b += length
    rng.shuffle(runs)
    return [i for run in runs for i in run][:n]


def device_copy_s(nbytes: int, device: str, reps: int) -> float:
    """Median seconds of one contiguous copy of nbytes on the device (torch copy_)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,64,256", help="request sizes in MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--peer-device", help="the prefill peer's device (default: --device)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the in-process copy (cma reads use one)")
    p.add_argument("--mean-run", type=float, default=4.0, help="mean run length of the `request` block lists")
    p.add_argument("--settings", help="comma list of " + ", ".join(SETTINGS) + ": one fresh run each")
    p.add_argument("--layouts", default="layer", help="comma list of layer, block")
    p.add_argument("--json", help="write every row here (with --settings)")
    p.add_argument("--setting", default="", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="layer", help=argparse.SUPPRESS)
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    per_block = block_bytes(args.layers)
    counts = [max(1, round(float(s) * MIB / per_block)) for s in args.sizes.split(",")]
    if args.peer:
        return run_peer(args)
    if args.settings:
        return drive(args)
    rows = run_one(args, counts, per_block)
    if args.rows_out:
        with open(args.rows_out, "w") as f:
            json.dump(rows, f)
    else:
        print_table(rows, args)


def drive(args: argparse.Namespace) -> None:
    """One fresh decode + prefill process pair per (setting, layout), each with its UCX variables."""
    from pdserve.disagg.nixl_connector import ucx_module_dir

    rows, base = [], {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    keep = ["--layers", str(args.layers), "--device", args.device,
            "--threads", str(args.threads), "--mean-run", str(args.mean_run)]
    if args.peer_device:
        keep += ["--peer-device", args.peer_device]
    for setting in args.settings.split(","):
        env = dict(base, **{k: v or ucx_module_dir() or "" for k, v in SETTINGS[setting].items()})
        reps = min(args.reps, 2) if setting == "default" else args.reps  # tcp: slow, and known
        sizes = args.sizes.split(",")[0] if setting == "default" else args.sizes
        for layout in args.layouts.split(","):
            out = f"/tmp/bench_transfer_{os.getpid()}_{setting}_{layout}.json"
            cmd = [sys.executable, os.path.abspath(__file__), *keep, "--sizes", sizes, "--reps", str(reps),
                   "--setting", setting, "--layout", layout, "--rows-out", out]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
            if done.returncode != 0:
                print(f"{setting} {layout}: exit {done.returncode}: {done.stderr[-800:]}", file=sys.stderr)
                continue
            with open(out) as f:
                rows += json.load(f)
            os.remove(out)
            print(f"{setting} {layout}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            if args.json:  # after every pair: a run cut short keeps what it measured
                meta = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(args))
                with open(args.json, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print_table(rows, args)


def run_one(args: argparse.Namespace, counts: list[int], per_block: int) -> list[dict]:
    """Every size and block-list shape, one setting (this process's environment), one layout."""
    args.num_blocks = 2 * max(counts)
    torch.set_num_threads(args.threads)

    from pdserve.disagg.nixl_connector import NixlConnector

    cmd = [sys.executable, os.path.abspath(__file__), "--peer", "--layers", str(args.layers)]
    peer_device = args.peer_device or args.device
    cmd += ["--device", peer_device, "--num-blocks", str(args.num_blocks), "--sizes", args.sizes]
    cmd += ["--setting", args.setting, "--layout", args.layout]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = []
    layers_per_desc = 1 if args.layout == "block" else args.layers
    try:
        url = ""
        for line in peer.stdout:  # lines UCX itself printed come first, if any
            if line.startswith("URL "):
                url = line.split()[1]
                break
        if not url:
            raise SystemExit(f"the prefill peer exited with {peer.wait()}")
        sys.stdout, console = sys.stderr, sys.stdout  # nixl logs to stdout; keep it for the table
        conn = NixlConnector("bench-decode", model_id="bench", transfer_timeout_s=120.0,
                             ucx_gpu_defaults=args.setting == "pdserve")
        conn.register_kv_cache(make_pool(args.layers, args.num_blocks, args.device, seed=None, layout=args.layout))
        src = make_pool(args.layers, args.num_blocks, peer_device, seed=0, layout=args.layout).regions["latent"]
        timed_read(conn, handle_for(url, "warm-up", [0], conn.compat_hash), [0])  # connection setup
        for n in counts:
            shapes = {
                "contiguous": (list(range(n)), list(range(n))),
                "request": (request_ids(n, args.num_blocks, args.mean_run, seed=n),
                            request_ids(n, args.num_blocks, args.mean_run, seed=n + 1)),
                "scattered": (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))),
            }
            dev_s = device_copy_s(n * per_block, args.device, args.reps)
            for kind, (src_ids, dst_ids) in shapes.items():
                read_s, copy_s = measure(conn, url, src, src_ids, dst_ids, args.reps, f"{kind}-{n}")
                descs = len(block_runs(src_ids, dst_ids)) * layers_per_desc
                rows.append(dict(setting=args.setting or "env", layout=args.layout, nbytes=n * per_block,
                                 blocks=n, kind=kind, descs=descs, read_s=read_s, copy_s=copy_s, dev_copy_s=dev_s))
        conn.shutdown()
    except TransferError as e:
        raise SystemExit(str(e)) from e
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)
    sys.stdout = console
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    where = args.device if not args.peer_device else f"{args.device} (read from {args.peer_device})"
    print(f"KV pool: 1 bf16 region, {args.layers} layers, {BLOCK_SIZE}-token blocks of {DIM} values on {where}")
    print(f"GB/s: median (best) of the reps; NIXL: start_load..poll_loads done, between two processes;")
    print(f"copy: the same runs with torch copy_ in one process; dev copy: one contiguous copy_ of the bytes")
    print(f"{'setting':>12} {'layout':>6} {'MiB':>7} {'blocks':>6} {'blocks as':>10} {'descs':>6} "
          f"{'NIXL GB/s':>14} {'copy GB/s':>14} {'dev copy':>8} {'NIXL/dev':>8}")
    for r in rows:
        nbytes = r["nbytes"]
        nixl, copy = nbytes / statistics.median(r["read_s"]) / 1e9, nbytes / statistics.median(r["copy_s"]) / 1e9
        nixl_best, copy_best = nbytes / min(r["read_s"]) / 1e9, nbytes / min(r["copy_s"]) / 1e9
        dev = nbytes / r["dev_copy_s"] / 1e9
        cols = f"{nixl:6.2f} ({nixl_best:5.2f}) {copy:6.2f} ({copy_best:5.2f}) {dev:8.1f} {nixl / dev:8.3f}"
        print(f"{r['setting']:>12} {r['layout']:>6} {nbytes / MIB:7.1f} {r['blocks']:6d} {r['kind']:>10} "
              f"{r['descs']:6d} {cols}")


if __name__ == "__main__":
    main()
