"""NIXL READ (decode pulls) against WRITE (prefill pushes) of one contiguous slab between two processes.

    python scripts/bench_nixl_write.py [--device cuda] [--sizes 4.7,64,549] [--reps 5] [--json PATH]

The staged transfer moves a request as one slab (disagg/staging.py): today decode READs it from
prefill's staging arena into its landing arena. The alternative is prefill WRITing the slab into
decode's landing arena. This measures both on the same two buffers, with pdserve's UCX defaults
for GPU pools (`apply_ucx_gpu_defaults`) and NIXL's progress thread on both agents (so neither
direction waits on the passive side's polling): per size, the median time from `transfer()` to
DONE at the initiator, the rate, and its share of one device copy of the same bytes in one
process. Every transfer is checked byte for byte at the destination. Two more columns split
what pdserve's own READ pays: `READ+notif` is the READ with a notification attached (pdserve's
"release:<id>", which NIXL delivers once the data is in), and `prep` the descriptor lists plus
`initialize_xfer` before `transfer()` (pdserve makes a transfer handle per request).

The parent process owns the destination ("decode"), a spawned child the source ("prefill").
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

MIB = 1 << 20
TIMEOUT_S = 30.0


def _agent(name: str, buf: torch.Tensor):
    from pdserve.disagg.nixl_connector import apply_ucx_gpu_defaults

    if buf.is_cuda:
        apply_ucx_gpu_defaults()
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    agent.register_memory([buf])
    return agent


def _desc(buf: torch.Tensor, nbytes: int) -> list[tuple[int, int, int]]:
    return [(buf.data_ptr(), nbytes, (buf.device.index or 0) if buf.is_cuda else 0)]


def _mem(buf: torch.Tensor) -> str:
    return "VRAM" if buf.is_cuda else "DRAM"


def _wait(agent, xfer) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    state = agent.transfer(xfer)
    while state != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"transfer ended in state {state}")
        state = agent.check_xfer_state(xfer)


def timed(agent, op: str, local, remote, peer: str, mem_local: str, mem_remote: str, notif: bytes = b"", prep: list | None = None) -> float:
    """Seconds from transfer() to DONE; prep, if given, gets the seconds of building the handle."""
    t = time.perf_counter()
    xfer = agent.initialize_xfer(op, agent.get_xfer_descs(local, mem_local), agent.get_xfer_descs(remote, mem_remote), peer, notif)
    if prep is not None:
        prep.append(time.perf_counter() - t)
    try:
        if mem_local == "VRAM":
            torch.cuda.synchronize()
        t = time.perf_counter()
        _wait(agent, xfer)
        return time.perf_counter() - t
    finally:
        agent.release_xfer_handle(xfer)


def child(conn, device: str, capacity: int, seed: int) -> None:
    """The source side ("prefill"): random bytes; WRITEs on request; progress by its NIXL thread."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (capacity,), dtype=torch.uint8, generator=gen).to(device)
    agent = _agent("prefill", src)
    conn.send({"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": src.data_ptr(), "dev": _desc(src, 1)[0][2]})
    peer_msg = conn.recv()
    peer = agent.add_remote_agent(base64.b64decode(peer_msg["meta"]))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        nbytes = msg["nbytes"]
        remote = [(peer_msg["addr"], nbytes, peer_msg["dev"])]
        try:
            conn.send({"s": timed(agent, "WRITE", _desc(src, nbytes), remote, peer, _mem(src), peer_msg["mem"])})
        except Exception as e:  # reported to the parent, which fails the run
            conn.send({"error": f"{type(e).__name__}: {e}"})
    agent.remove_remote_agent(peer)


def copy_s(nbytes: int, device: str, reps: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        if a.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if a.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="4.7,64,549", help="slab sizes in MiB (4.7: a 1K-token V3 request; 549: 8K tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
    capacity = max(sizes)
    gen = torch.Generator().manual_seed(args.seed)
    want = torch.randint(0, 256, (capacity,), dtype=torch.uint8, generator=gen)  # the child draws the same bytes

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=child, args=(child_conn, args.device, capacity, args.seed), daemon=True)
    proc.start()
    rows = []
    try:
        if not conn.poll(120):
            raise SystemExit("the source process did not start")
        src_msg = conn.recv()
        dst = torch.zeros(capacity, dtype=torch.uint8, device=args.device)
        agent = _agent("decode", dst)
        peer = agent.add_remote_agent(base64.b64decode(src_msg["meta"]))
        conn.send({"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": dst.data_ptr(), "dev": _desc(dst, 1)[0][2], "mem": _mem(dst)})
        mem = _mem(dst)
        for nbytes in sizes:
            row = {"mib": round(nbytes / MIB, 1), "copy_s": copy_s(nbytes, args.device, args.reps)}
            for op in ("READ", "READ+notif", "WRITE"):
                times, prep = [], []
                for _ in range(args.reps + 1):  # the first one maps the peer's memory: not timed
                    dst[:nbytes].zero_()
                    if op.startswith("READ"):
                        notif = b"release:bench" if op == "READ+notif" else b""
                        s = timed(agent, "READ", _desc(dst, nbytes), [(src_msg["addr"], nbytes, src_msg["dev"])], peer, mem, mem, notif, prep)
                    else:
                        conn.send({"nbytes": nbytes})
                        if not conn.poll(TIMEOUT_S + 5):
                            raise SystemExit("the source process did not answer")
                        reply = conn.recv()
                        if "error" in reply:
                            raise SystemExit(f"WRITE failed: {reply['error']}")
                        s = reply["s"]
                    if dst.is_cuda:
                        torch.cuda.synchronize()
                    if not torch.equal(dst[:nbytes].cpu(), want[:nbytes]):
                        raise SystemExit(f"{op} of {nbytes} bytes is not byte-exact")
                    times.append(s)
                med = statistics.median(times[1:])
                row[op.lower().replace("+", "_")] = {"s": med, "gb_s": nbytes / med / 1e9, "of_copy": row["copy_s"] / med}
                if prep:
                    row[op.lower().replace("+", "_")]["prep_s"] = statistics.median(prep[1:])
            rows.append(row)
        conn.send(None)
        agent.remove_remote_agent(peer)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"NIXL READ vs WRITE, one slab between two processes on {dev}; median of {args.reps} after one untimed")
    print("| MiB | copy GB/s | READ ms | READ GB/s | / copy | READ+notif ms | prep ms | WRITE ms | WRITE GB/s | / copy |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        n = r["mib"] * MIB
        print(f"| {r['mib']} | {n / r['copy_s'] / 1e9:.0f} | {1e3 * r['read']['s']:.3f} | {r['read']['gb_s']:.1f} | {r['read']['of_copy']:.3f} "
              f"| {1e3 * r['read_notif']['s']:.3f} | {1e3 * r['read_notif']['prep_s']:.3f} "
              f"| {1e3 * r['write']['s']:.3f} | {r['write']['gb_s']:.1f} | {r['write']['of_copy']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
