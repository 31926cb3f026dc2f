"""`pdserve launch` with real processes on free ports: health, NUMA affinity, clean stop, failures."""

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from pdserve.config import load_config, parse_config
from pdserve.launch import plan, port_free
from pdserve.numa import numa_nodes, process_cpus
from tests.helpers.launch import (
    STARTUP_S,
    free_ports,
    health,
    pdserve,
    start_launch,
    stop_group,
    table_pids,
    wait_up,
    write_config,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


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
    cpu_cfg = parse_config(
        {
            "model": "tiny:deepseek_v3",
            "colocated": [{"port": 30000, "tp_size": 2, "numa_node": 0, "cpus": f"{cpus[0]}"}],
        }
    )
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
