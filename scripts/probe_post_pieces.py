"""Where the time of posting a same-host copy goes (CopyQueue.start, 64 MiB of a V3 request), piece
by piece, and how the machine's state before the post changes it.

    python scripts/probe_post_pieces.py [--json out.json]

Pieces (host perf_counter, microseconds, median of 40 posts): `put` the ids into the pinned ring,
`launch` the copy kernel (CopyQueue.bind's BoundCopy, ids by address, side stream), `event` a new CUDA event, `record` it,
`to_done` polling the event until the copy is done. Before each post: nothing (`none`, right after
a synchronize), 2 ms of host sleep (`sleep`), 2 ms of host spinning (`spin`), either with the GPU
kept busy by a spinning kernel on another stream (`+gpu`), or sleep then one cheap CUDA call
(`touch`). Modes: `ring` (CopyQueue.start's own steps), `pre-event` (events made ahead),
`devring` (the ids copied to a device ring by an async copy on the side stream first, the kernel
reading them there). The copy's bytes are checked once per mode.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.disagg.cuda_ipc import CopyQueue, _even  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--json", help="write the rows here")
args = p.parse_args()

dev = torch.device("cuda", 0)
LAYERS, WORDS = 61, 64 * 576 * 2 // 8
n = round(64 * (1 << 20) / (LAYERS * WORDS * 8))
pool = 2 * n + 4
src = torch.randint(-(1 << 62), 1 << 62, (LAYERS, pool, WORDS), dtype=torch.int64, device=dev)
dst = torch.zeros_like(src)
rng = random.Random(0)
sids, dids = rng.sample(range(pool), n), rng.sample(range(pool), n)
q = CopyQueue(dev)
copy = q.bind({"kv": (src, dst)})["kv"].launch
awake = torch.cuda.Stream(dev)
spin_cycles = int(torch.cuda.get_device_properties(dev).clock_rate * 1e3 * 0.004)
dring = torch.empty(1 << 16, dtype=torch.int64, device=dev)
dbase = dring.data_ptr()
pre_events = [torch.cuda.Event() for _ in range(2000)]
ev_i = [0]


def pieces(mode: str) -> list[float]:
    t = [time.perf_counter()]
    ids = sids + [0] * (n & 1) + dids + [0] * (n & 1)
    buf, at = q.ring.put(ids)
    t.append(time.perf_counter())
    m = _even(n)
    if mode == "devring":
        with torch.cuda.stream(q.stream):
            dring[: len(ids)].copy_(buf, non_blocking=True)
        copy(dbase, dbase + 8 * m, n)
    else:
        base = q.ring.addr + 8 * at
        copy(base, base + 8 * m, n)
    t.append(time.perf_counter())
    if mode == "pre-event":
        e = pre_events[ev_i[0] % 2000]
        ev_i[0] += 1
    else:
        e = torch.cuda.Event()
    t.append(time.perf_counter())
    e.record(q.stream)
    t.append(time.perf_counter())
    q.ring.hold(at, len(ids), e)
    while not e.query():
        pass
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])] + [t[-1] - t[0]]


def spin(s: float) -> None:
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass


rows = []
for mode in ("ring", "pre-event", "devring"):
    for _ in range(5):
        pieces(mode)
    torch.cuda.synchronize()
    dst.zero_()
    torch.cuda.synchronize()  # the copy's stream does not wait for the default one
    pieces(mode)
    torch.cuda.synchronize()
    if not torch.equal(dst[:, dids], src[:, sids]):
        raise SystemExit(f"{mode}: wrong bytes")
    for cond in ("none", "sleep", "spin", "sleep+gpu", "spin+gpu", "touch"):
        res = []
        for _ in range(40):
            torch.cuda.synchronize()
            if "gpu" in cond:
                with torch.cuda.stream(awake):
                    torch.cuda._sleep(spin_cycles)
            if cond.startswith("sleep"):
                time.sleep(0.002)
            elif cond.startswith("spin"):
                spin(0.002)
            elif cond == "touch":
                time.sleep(0.002)
                torch.cuda.current_stream().query()
            res.append(pieces(mode))
        med = [statistics.median(c) * 1e6 for c in zip(*res)]
        rows.append(dict(mode=mode, cond=cond, put=med[0], launch=med[1], event=med[2], record=med[3], to_done=med[4], total=med[5]))
print(torch.cuda.get_device_name(dev), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), f"{n} blocks, {LAYERS * n * WORDS * 8 / 2**20:.0f} MiB")
print(f"{'mode':<10}{'cond':<11}{'put':>7}{'launch':>8}{'event':>7}{'record':>8}{'to_done':>9}{'total':>8}  (us)")
for r in rows:
    print(f"{r['mode']:<10}{r['cond']:<11}{r['put']:7.1f}{r['launch']:8.1f}{r['event']:7.1f}{r['record']:8.1f}{r['to_done']:9.1f}{r['total']:8.1f}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
