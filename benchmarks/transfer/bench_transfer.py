"""NIXL READ rate between two processes against a torch copy inside one, for a few request sizes.

    python -m benchmarks.transfer.bench_transfer [--sizes 1,16,64,256] [--reps 5] [--device cpu] [--peer-device cuda:1]
    python -m benchmarks.transfer.bench_transfer --device cuda:0 --settings default,zcopy,zcopy+moddir,pdserve \
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
descriptor per run) as a one-layer pool of L*bs-token blocks: the same bytes per block;
`staged` is pdserve's pool with staged transfer (pdserve/disagg/staging.py): the peer gathers the
request's blocks into one slab of its staging arena (`gather`), decode READs it as one
descriptor into its landing arena (`read`) and scatters it into its blocks (`scatter`), each timed;
`ipc` is pdserve's pool read the same-host way (pdserve/disagg/cuda_ipc.py): decode maps the
peer's pool through CUDA IPC once and copies a request's blocks with one kernel of its own
(start_load..done; no descriptors, no gather, no progress on the peer's side). Only `ipc` runs
with the connectors' `cuda_ipc` option on.

The peer runs as a prefill worker's engine loop does: every --peer-poll-ms it polls the connector
(release notifications; NIXL's progress thread is off, as in a worker, unless --peer-progress-thread)
and, with --peer-busy-ms B, runs B ms of GPU matmuls before each poll (a prefill step in the other
process: what a decode read competes with on a shared GPU).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

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
    from pdserve.disagg.factory import StagingOptions
    from pdserve.disagg.nixl.connector import NixlConnector

    staged = args.layout == "staged"
    staging = StagingOptions(mode="on" if staged else "off", prefill_arena_mib=args.arena_mib, decode_arena_mib=0)
    conn = NixlConnector(
        "bench-prefill",
        model_id="bench",
        ucx_gpu_defaults=args.setting == "pdserve",
        progress_thread=args.peer_progress_thread,
        progress_interval_ms=float(args.peer_progress_interval_ms),
        role="prefill",
        staging=staging,
        lease_s=3600.0,
        cuda_ipc=args.layout == "ipc",
    )
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
    inbox: list[dict] = []
    lock, stop = threading.Lock(), threading.Event()
    busy = busy_work(args.device, float(args.peer_busy_ms))

    def engine_loop() -> None:  # one thread owns the connector, as a worker's engine thread does
        while not stop.is_set():
            busy()
            with lock:
                cmds, inbox[:] = list(inbox), []
            conn.poll_releases()
            for cmd in cmds:
                before = conn.stats.stage_seconds_sum
                handle = conn.on_prefill_finished(cmd["rid"], cmd["ids"], cmd["tokens"])
                gather_s = conn.stats.stage_seconds_sum - before
                replies.write("HANDLE " + json.dumps({"handle": handle.model_dump(), "gather_s": gather_s}) + "\n")
                replies.flush()
            time.sleep(args.peer_poll_ms / 1000)

    loop = threading.Thread(target=engine_loop, daemon=True)
    loop.start()
    replies.write(f"URL http://127.0.0.1:{server.server_address[1]}/metadata\n")  # UCX may print to fd 1 too
    replies.flush()
    for line in sys.stdin:  # until the decode side closes our stdin
        with lock:
            inbox.append(json.loads(line))
    stop.set()
    loop.join()
    conn.shutdown()
    server.shutdown()


def busy_work(device: str, busy_ms: float):
    """A callable that keeps the GPU busy for about busy_ms (bf16 matmuls, synchronized), or does nothing."""
    if busy_ms <= 0 or not device.startswith("cuda"):
        return lambda: None
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)

    def run() -> None:
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1000 < busy_ms:
            for _ in range(8):
                torch.mm(a, a, out=b)
            torch.cuda.synchronize(device)

    return run


POSTS: list[float] = []  # start_load's own seconds (the CPU part of posting), per read


def timed_read(conn, handle: KVHandle, dst_ids: list[int]) -> float:
    t0 = time.perf_counter()
    conn.start_load(handle, dst_ids, PEER.get(handle.metadata_url))
    POSTS.append(time.perf_counter() - t0)
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


def fetch_peer(url: str) -> PeerMetadata:
    body = httpx.get(url, timeout=10).content
    info = json.loads(body)
    return PeerMetadata(engine_id=info["engine_id"], instance_id=info["instance_id"], data=body)


def handle_for(url: str, request_id: str, block_ids: list[int], compat: str) -> KVHandle:
    # per-block layouts: the peer's pool is static, so the handle is made here (no lease)
    if url not in PEER:
        PEER[url] = fetch_peer(url)
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


class PeerProc:
    """The prefill peer process: its metadata URL, and handles it makes (a staged one gathers)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.url = proc, ""
        for line in proc.stdout:  # lines UCX itself printed come first, if any
            if line.startswith("URL "):
                self.url = line.split()[1]
                break
        if not self.url:
            raise SystemExit(f"the prefill peer exited with {proc.wait()}")

    def prefill(self, rid: str, ids: list[int]) -> tuple[KVHandle, float]:
        self.proc.stdin.write(json.dumps({"rid": rid, "ids": ids, "tokens": len(ids) * BLOCK_SIZE}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("HANDLE "):
                doc = json.loads(line[len("HANDLE ") :])
                return KVHandle.model_validate(doc["handle"]), doc["gather_s"]
        raise SystemExit(f"the prefill peer exited with {self.proc.wait()}")


def measure(
    conn, peer: PeerProc, src: torch.Tensor, src_ids: list[int], dst_ids: list[int], reps: int, name: str, staged: bool
):
    """Seconds of every rep for one request shape: NIXL read (start_load..done: for a staged
    layout the READ and the scatter, split by the connector's own scatter time), gather (staged:
    in the peer), in-process copy."""
    dst = conn.kv.regions["latent"]
    out = {"read_s": [], "copy_s": [], "gather_s": [], "scatter_s": [], "post_s": []}
    for rep in range(reps):
        dst.zero_()
        if dst.is_cuda:  # done before the read: a same-host copy runs on the connector's own stream
            torch.cuda.synchronize(dst.device)
        if staged:
            handle, gather_s = peer.prefill(f"{name}-{rep}", src_ids)
            if handle.staged is None:
                raise SystemExit(f"{name}: the peer's staging arena had no room (--arena-mib)")
            out["gather_s"].append(gather_s)
        else:
            handle = handle_for(peer.url, f"{name}-{rep}", src_ids, conn.compat_hash)
        before = conn.stats.stage_seconds_sum
        total = timed_read(conn, handle, dst_ids)
        out["post_s"].append(POSTS[-1])
        scatter_s = conn.stats.stage_seconds_sum - before
        out["read_s"].append(total - scatter_s if staged else total)
        out["scatter_s"].append(scatter_s)
        if rep == 0 and not torch.equal(
            dst[:, dst_ids].view(torch.int16), src[:, src_ids].to(dst.device).view(torch.int16)
        ):
            raise SystemExit(f"NIXL READ {name} is not byte-exact")
        out["copy_s"].append(timed_copy(dst, src, src_ids, dst_ids))
    return out


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
    p.add_argument("--layouts", default="layer", help="comma list of layer, block, staged, ipc")
    p.add_argument("--kinds", default="contiguous,request,scattered", help="block lists to read (comma list)")
    p.add_argument("--arena-mib", type=int, default=0, help="staged: each side's arena (default: 2x the largest size)")
    p.add_argument(
        "--peer-poll-ms", type=float, default=20.0, help="the peer polls its connector this often (a worker: 20)"
    )
    p.add_argument(
        "--peer-busy-ms", default="0", help="comma list: GPU work (ms) the peer runs before each poll; one run each"
    )
    p.add_argument(
        "--peer-progress-thread", action="store_true", help="the peer runs NIXL's progress thread (a worker does not)"
    )
    p.add_argument(
        "--peer-progress-interval-ms",
        default="1",
        help="comma list: the peer connector's progress thread interval (0: none); one run each",
    )
    p.add_argument("--tag", default="", help="a name for this run's rows (e.g. the environment it set)")
    p.add_argument("--json", help="write every row here (with --settings)")
    p.add_argument("--setting", default="", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="layer", help=argparse.SUPPRESS)
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.arena_mib:
        args.arena_mib = max(1, int(2 * max(float(x) for x in args.sizes.split(",")) + 1))
    return args


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
    from pdserve.disagg.nixl.ucx_env import ucx_module_dir

    rows, base = [], {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    keep = [
        "--layers",
        str(args.layers),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--mean-run",
        str(args.mean_run),
        "--kinds",
        args.kinds,
        "--arena-mib",
        str(args.arena_mib),
        "--peer-poll-ms",
        str(args.peer_poll_ms),
        "--tag",
        args.tag,
    ]
    if args.peer_progress_thread:
        keep.append("--peer-progress-thread")
    if args.peer_device:
        keep += ["--peer-device", args.peer_device]
    for setting in args.settings.split(","):
        env = dict(base, **{k: v or ucx_module_dir() or "" for k, v in SETTINGS[setting].items()})
        reps = min(args.reps, 2) if setting == "default" else args.reps  # tcp: slow, and known
        sizes = args.sizes.split(",")[0] if setting == "default" else args.sizes
        runs = [
            (lo, b, i)
            for lo in args.layouts.split(",")
            for b in args.peer_busy_ms.split(",")
            for i in args.peer_progress_interval_ms.split(",")
        ]
        for layout, busy, interval in runs:
            out = f"/tmp/bench_transfer_{os.getpid()}_{setting}_{layout}.json"
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *keep,
                "--sizes",
                sizes,
                "--reps",
                str(reps),
                "--setting",
                setting,
                "--layout",
                layout,
                "--rows-out",
                out,
                "--peer-busy-ms",
                busy,
                "--peer-progress-interval-ms",
                interval,
            ]
            t0 = time.perf_counter()
            done = subprocess.run(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900
            )
            if done.returncode != 0:
                print(f"{setting} {layout}: exit {done.returncode}: {done.stderr[-800:]}", file=sys.stderr)
                continue
            with open(out) as f:
                rows += json.load(f)
            os.remove(out)
            print(
                f"{setting} {layout} busy {busy} progress {interval}: {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # after every pair: a run cut short keeps what it measured
                meta = dict(
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    args=vars(args),
                )
                with open(args.json, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print_table(rows, args)


def run_one(args: argparse.Namespace, counts: list[int], per_block: int) -> list[dict]:
    """Every size and block-list shape, one setting (this process's environment), one layout."""
    args.num_blocks = 2 * max(counts)
    torch.set_num_threads(args.threads)

    from pdserve.disagg.nixl.connector import NixlConnector

    cmd = [sys.executable, os.path.abspath(__file__), "--peer", "--layers", str(args.layers)]
    peer_device = args.peer_device or args.device
    cmd += ["--device", peer_device, "--num-blocks", str(args.num_blocks), "--sizes", args.sizes]
    cmd += ["--setting", args.setting, "--layout", args.layout, "--arena-mib", str(args.arena_mib)]
    cmd += ["--peer-poll-ms", str(args.peer_poll_ms), "--peer-busy-ms", str(args.peer_busy_ms)]
    cmd += ["--peer-progress-interval-ms", str(args.peer_progress_interval_ms)]
    if args.peer_progress_thread:
        cmd.append("--peer-progress-thread")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = []
    staged = args.layout == "staged"
    layers_per_desc = 1 if args.layout == "block" else args.layers
    try:
        peer = PeerProc(proc)
        sys.stdout, console = sys.stderr, sys.stdout  # nixl logs to stdout; keep it for the table
        from pdserve.disagg.factory import StagingOptions

        staging = StagingOptions(mode="on" if staged else "off", prefill_arena_mib=0, decode_arena_mib=args.arena_mib)
        conn = NixlConnector(
            "bench-decode",
            model_id="bench",
            transfer_timeout_s=120.0,
            role="decode",
            staging=staging,
            ucx_gpu_defaults=args.setting == "pdserve",
            progress_thread=False,  # as a worker
            cuda_ipc=args.layout == "ipc",
        )
        conn.register_kv_cache(make_pool(args.layers, args.num_blocks, args.device, seed=None, layout=args.layout))
        src = make_pool(args.layers, args.num_blocks, peer_device, seed=0, layout=args.layout).regions["latent"]
        timed_read(conn, handle_for(peer.url, "warm-up", [0], conn.compat_hash), [0])  # connection setup
        for n in counts:
            shapes = {
                "contiguous": (list(range(n)), list(range(n))),
                "request": (
                    request_ids(n, args.num_blocks, args.mean_run, seed=n),
                    request_ids(n, args.num_blocks, args.mean_run, seed=n + 1),
                ),
                "scattered": (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))),
            }
            dev_s = device_copy_s(n * per_block, args.device, args.reps)
            for kind in args.kinds.split(","):
                src_ids, dst_ids = shapes[kind]
                before = dict(conn.stats.paths)
                times = measure(conn, peer, src, src_ids, dst_ids, args.reps, f"{kind}-{n}", staged)
                path = ",".join(p for p, c in conn.stats.paths.items() if c > before.get(p, 0))  # how the reads moved
                descs = (
                    1 if staged else 0 if path == "cuda_ipc" else len(block_runs(src_ids, dst_ids)) * layers_per_desc
                )
                rows.append(
                    dict(
                        setting=args.setting or "env",
                        tag=args.tag,
                        layout=args.layout,
                        path=path,
                        nbytes=n * per_block,
                        blocks=n,
                        kind=kind,
                        descs=descs,
                        dev_copy_s=dev_s,
                        peer_busy_ms=float(args.peer_busy_ms),
                        peer_progress_thread=args.peer_progress_thread,
                        peer_progress_interval_ms=float(args.peer_progress_interval_ms),
                        **times,
                    )
                )
        conn.shutdown()
    except TransferError as e:
        raise SystemExit(str(e)) from e
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    sys.stdout = console
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    where = args.device if not args.peer_device else f"{args.device} (read from {args.peer_device})"
    print(f"KV pool: 1 bf16 region, {args.layers} layers, {BLOCK_SIZE}-token blocks of {DIM} values on {where}")
    print("GB/s: median (best) of the reps; NIXL: start_load..poll_loads done, between two processes;")
    print("copy: the same runs with torch copy_ in one process; dev copy: one contiguous copy_ of the bytes")
    print(
        "staged: NIXL = gather + READ + scatter (end to end, each in ms after it); busy: the peer's GPU work per poll (ms)"
    )
    print(
        f"{'setting':>12} {'layout':>6} {'busy':>5} {'prog':>4} {'MiB':>7} {'blocks':>6} {'blocks as':>10} {'descs':>6} "
        f"{'NIXL GB/s':>14} {'copy GB/s':>14} {'dev copy':>8} {'NIXL/dev':>8} {'read ms':>8} {'max ms':>7}  staged ms"
    )
    for r in rows:
        nbytes, med = r["nbytes"], statistics.median
        gather, scatter = med(r.get("gather_s") or [0.0]), med(r.get("scatter_s") or [0.0])
        total = med(r["read_s"]) + gather + scatter
        nixl, copy = nbytes / total / 1e9, nbytes / med(r["copy_s"]) / 1e9
        nixl_best, copy_best = nbytes / (min(r["read_s"]) + gather + scatter) / 1e9, nbytes / min(r["copy_s"]) / 1e9
        dev = nbytes / r["dev_copy_s"] / 1e9
        cols = f"{nixl:6.2f} ({nixl_best:5.2f}) {copy:6.2f} ({copy_best:5.2f}) {dev:8.1f} {nixl / dev:8.3f}"
        times = f"{med(r['read_s']) * 1e3:8.3f} {max(r['read_s']) * 1e3:7.2f}"
        split = (
            f"  gather {gather * 1e3:.3f} read {med(r['read_s']) * 1e3:.3f} scatter {scatter * 1e3:.3f}"
            if r.get("gather_s")
            else ""
        )
        split += f"  post {med(r['post_s']) * 1e3:.3f}" if r.get("post_s") else ""
        prog = "nixl" if r.get("peer_progress_thread") else f"{r.get('peer_progress_interval_ms', 0):4.0f}"
        layout = r["layout"] if r.get("path", "cuda_ipc") == "cuda_ipc" or r["layout"] != "ipc" else f"ipc>{r['path']}"
        print(
            f"{r['setting']:>12} {layout:>6} {r.get('peer_busy_ms', 0):5.0f} {prog:>4} {nbytes / MIB:7.1f} {r['blocks']:6d} "
            f"{r['kind']:>10} {r['descs']:6d} {cols} {times}{split}"
        )


if __name__ == "__main__":
    main()
