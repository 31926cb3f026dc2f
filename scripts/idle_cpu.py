"""CPU an idle pdserve cluster burns: start `pdserve launch` (tiny model, free ports), let it settle,
then sum user + system CPU time of every process of the launch (router, workers, their children)
over a window from /proc/<pid>/stat, and print it per process as a share of one core.

    python scripts/idle_cpu.py [--seconds 30] [--progress-thread on|off]

--progress-thread sets transfer.options.progress_thread (NIXL's own UCX progress thread) for the
workers; without the flag the config's default applies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import free_port  # noqa: E402  (ports below the ephemeral range)

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def measure(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """name -> CPU seconds per wall second over `seconds` (1.0 = one core busy), children included."""
    tree = {name: descendants(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    before = {name: sum(cpu_ticks(p) for p in ps) for name, ps in tree.items()}
    time.sleep(seconds)
    after = {name: sum(cpu_ticks(p) for p in ps) for name, ps in tree.items()}
    wall = time.monotonic() - t0
    return {name: (after[name] - before[name]) / TICKS / wall for name in tree}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after startup before measuring")
    ap.add_argument("--progress-thread", choices=["on", "off"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-idle-"))
    ports = [free_port() for _ in range(3)]
    worker = {"kv_block_size": 16, "num_kv_blocks": 256}
    cfg = {
        "model": "tiny:deepseek_v3", "router": {"port": ports[0]},
        "prefill": [{**worker, "port": ports[1]}], "decode": [{**worker, "port": ports[2]}],
        "log_dir": str(tmp / "logs"), "startup_timeout": 300,
    }  # fmt: skip
    if args.progress_thread:
        cfg["transfer"] = {"options": {"progress_thread": args.progress_thread == "on"}}
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "launch.out"
    with open(out, "wb") as f:
        launcher = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--config", str(tmp / "cluster.yaml")], cwd=ROOT,
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 330
        while "pdserve is up" not in out.read_text():
            if launcher.poll() is not None or time.monotonic() > deadline:
                print(out.read_text(), file=sys.stderr)
                return 1
            time.sleep(0.5)
        time.sleep(args.settle)
        status = json.loads((tmp / "logs" / "status.json").read_text())
        pids = {p["name"]: p["pid"] for p in status["processes"]}
        shares = measure(pids, args.seconds)
        pt = args.progress_thread or "default"
        print(f"idle CPU over {args.seconds:.0f} s (progress_thread {pt}), share of one core:")
        for name, share in shares.items():
            print(f"  {name:10s} {share * 100:6.1f}%")
        print(f"  {'total':10s} {sum(shares.values()) * 100:6.1f}%")
        return 0
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


if __name__ == "__main__":
    sys.exit(main())
