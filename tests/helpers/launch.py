"""`pdserve launch` as a test starts it: a config on free ports, the launcher in its own session,
waits for it to be up, stops its whole process group."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pdserve.numa import numa_nodes
from tests.helpers.cluster import free_port  # one module instance: its handed-out ports are shared

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 240


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def pdserve(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "pdserve", *args], cwd=ROOT, env=env, **kw)


def health(*urls: str) -> int:
    args = [a for u in urls for a in ("--url", u)]
    return pdserve("health", *args, "--timeout", "2", stdout=subprocess.DEVNULL).wait(timeout=30)


def write_config(tmp: Path, ports: list[int], **extra) -> Path:
    cpus = sorted(set(numa_nodes()[0]) & os.sched_getaffinity(0))
    worker = {"numa_node": 0, "kv_block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
    cfg = {
        "model": "tiny:deepseek_v3",
        "router": {"port": ports[0], "health_interval": 0.5},
        "prefill": [{**worker, "port": ports[1], "cpus": str(cpus[0])}],
        "decode": [{**worker, "port": ports[2], "cpus": str(cpus[-1])}],
        "log_dir": str(tmp / "logs"),
        "startup_timeout": STARTUP_S,
        "stop_grace_seconds": 5,
        **extra,
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def table_pids(output: str) -> dict[str, int]:
    """process name -> pid, from the launcher's table."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(prefill-0|decode-0|router)\s+\S+\s+\d+\s+(\d+)", output, re.M)}


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_launch(config: Path, tmp: Path, env: dict | None = None, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`pdserve launch --config` in its own session, output to tmp/launch.out, cache in tmp/cache;
    env: more environment for the launcher (and so its children); flags: more launch flags."""
    out = tmp / "launch.out"
    with open(out, "wb") as f:
        proc = pdserve("launch", "--config", str(config), *flags, env={"PDSERVE_CACHE": str(tmp / "cache"), **(env or {})},
                       stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, out


def wait_up(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + STARTUP_S + 30
    while "pdserve is up" not in out.read_text():
        assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{out.read_text()}"
        assert time.monotonic() < deadline, f"launcher not up:\n{out.read_text()}"
        time.sleep(0.5)
