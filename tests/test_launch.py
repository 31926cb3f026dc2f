"""`pdserve launch` with real processes on free ports: health, NUMA affinity, clean stop, failures."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.config import load_config, parse_config
from pdserve.launch import plan, port_free
from pdserve.numa import numa_nodes, process_cpus
from cluster import free_port  # one module instance: its handed-out ports are shared

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
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


def start_launch(config: Path, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """`pdserve launch --config` in its own session, output to tmp/launch.out, cache in tmp/cache."""
    out = tmp / "launch.out"
    with open(out, "wb") as f:
        proc = pdserve("launch", "--config", str(config), env={"PDSERVE_CACHE": str(tmp / "cache")},
                       stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, out


def wait_up(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + STARTUP_S + 30
    while "pdserve is up" not in out.read_text():
        assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{out.read_text()}"
        assert time.monotonic() < deadline, f"launcher not up:\n{out.read_text()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    ports = free_ports(3)
    config = write_config(tmp, ports)
    proc, out = start_launch(config, tmp)
    pids: dict[str, int] = {}
    try:
        wait_up(proc, out)
        pids = table_pids(out.read_text())
        yield {"proc": proc, "ports": ports, "pids": pids, "out": out, "tmp": tmp}
    finally:
        stop_group(proc)
        for pid in pids.values():  # never leave a server behind, whatever the test did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def urls(ports: list[int]) -> list[str]:
    return [f"http://127.0.0.1:{p}" for p in ports]


def test_every_process_healthy_and_tabled(cluster):
    assert health(*urls(cluster["ports"])) == 0
    assert set(cluster["pids"]) == {"prefill-0", "decode-0", "router"}
    for u in urls(cluster["ports"]):
        assert httpx.get(u + "/health", trust_env=False).status_code == 200
    made = cluster["tmp"] / "cache" / "tiny-deepseek_v3-seed0" / "config.json"
    assert made.is_file()  # tiny:deepseek_v3 was made in $PDSERVE_CACHE on first use
    logs = cluster["tmp"] / "logs"
    assert {p.name for p in logs.iterdir()} >= {"prefill-0.log", "decode-0.log", "router.log"}


def test_worker_affinity_is_what_the_config_says(cluster):
    cpus = sorted(set(numa_nodes()[0]) & os.sched_getaffinity(0))
    pids = cluster["pids"]
    for name, role, want in (("prefill-0", "prefill", [cpus[0]]), ("decode-0", "decode", [cpus[-1]])):
        with open(f"/proc/{pids[name]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        config = Path(argv[argv.index(b"--config") + 1].decode())
        assert config.name == f"{name}.json" and json.loads(config.read_text())["role"] == role
        assert process_cpus(pids[name]) == want, name
    assert process_cpus(pids["router"]) == sorted(os.sched_getaffinity(0))  # the router is not pinned


def test_children_get_their_config_in_a_private_file_not_in_argv(cluster):
    for name, pid in cluster["pids"].items():
        config = cluster["tmp"] / "logs" / f"{name}.json"
        secret = json.loads(config.read_text())["cluster_secret"]
        assert secret and config.stat().st_mode & 0o777 == 0o600, name  # a fresh secret, readable by its owner only
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret.encode() not in f.read(), name


def test_sigterm_stops_every_child_and_frees_the_ports(cluster):
    proc = cluster["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    for name, pid in cluster["pids"].items():
        assert not os.path.exists(f"/proc/{pid}"), f"{name} (pid {pid}) still exists"
    for port in cluster["ports"]:
        assert port_free("127.0.0.1", port), port
    assert health(*urls(cluster["ports"])) == 1
    assert "all processes stopped" in cluster["out"].read_text()


def test_refuses_busy_ports(tmp_path):
    ports = free_ports(3)
    config = write_config(tmp_path, ports)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[1]))
        busy.listen()
        proc = pdserve("launch", "--config", str(config), env={"PDSERVE_CACHE": str(tmp_path / "cache")},
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert f"ports already in use: prefill-0 (127.0.0.1:{ports[1]})" in out


def test_plans_tensor_parallel_workers(monkeypatch):
    """The reference topology: each TP4 worker is one `serve -tp 4` process that sees its 4 GPUs;
    a CPU worker's gloo ranks share its pinned CPUs."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config("8x-rtx-pro-6000-pd")
    unpinned = {g: [w.model_copy(update={"numa_node": None}) for w in getattr(cfg, g)] for g in ("prefill", "decode")}
    prefill, decode, _ = plan(cfg.model_copy(update=unpinned), "/models/ckpt")
    for spec, gpus in ((prefill, "0,1,2,3"), (decode, "4,5,6,7")):
        assert spec.config.worker.tp_size == 4
        assert spec.config.worker.device == "cuda"
        assert spec.env["CUDA_VISIBLE_DEVICES"] == gpus
    cpus = sorted(os.sched_getaffinity(0))
    cpu_cfg = parse_config({"model": "tiny:deepseek_v3", "colocated": [{"port": 30000, "tp_size": 2, "numa_node": 0, "cpus": f"{cpus[0]}"}]})
    worker = plan(cpu_cfg, "/models/ckpt")[0]
    assert worker.config.worker.tp_size == 2
    assert worker.env["OMP_NUM_THREADS"] == "1"  # one CPU for two ranks: never fewer than one thread


def test_a_worker_that_dies_at_startup_is_reported_with_its_log(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "not-a-model"}')
    ports = free_ports(3)
    config = write_config(tmp_path, ports, model=str(model))
    proc = pdserve("launch", "--config", str(config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=STARTUP_S)
    assert proc.returncode == 1, out
    assert re.search(r"(prefill-0|decode-0) \(pid \d+\) exited with code \d+ while starting; last lines of", out), out
    assert "all processes stopped" in out
    for port in ports:
        assert port_free("127.0.0.1", port)
