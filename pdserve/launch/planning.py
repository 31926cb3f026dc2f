"""The plan of a launch: one process spec per worker and the router, from the cluster config.

Each worker gets its role's peers, an engine id, its NUMA pinning (`pdserve.numa`), its GPUs
(CUDA_VISIBLE_DEVICES in config order, PCI bus order) and the transfer environment; the router
gets the workers' URLs (advertised ones where set) and, with an API key, the header its /health
needs. Each child runs the ServeConfig written here as a file (mode 0600: the cluster secret
stays out of argv).

A worker with tp_size N is one `serve --tensor-parallel-size N` process that starts its other
N-1 ranks itself: on CUDA it sees exactly its `gpus` and rank r uses the r-th; on CPU its ranks
are gloo processes sharing its pinned CPUs.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config import ClusterConfig, RestartPolicy, WorkerConfig
from pdserve.numa import PinPlan, plan_pinning
from pdserve.serve_config import RouterServeConfig, WorkerServeConfig


@dataclass
class ProcSpec:
    name: str
    role: str  # prefill | decode | colocated | router
    host: str
    port: int
    config: WorkerServeConfig | RouterServeConfig  # what the child runs (written to a file at start)
    env: dict[str, str]
    pin: PinPlan
    gpus: list[int] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # for its /health (the router's API key)
    restart: RestartPolicy = "on-failure"

    @property
    def url(self) -> str:
        return _url(self.host, self.port)


def _url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to host:port."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


def _worker_url(w: WorkerConfig) -> str:
    """Where the router reaches a worker: its advertised address when one is set, else as local."""
    return w.advertised_url() if w.advertise_host else _url(w.host, w.port)


def worker_spec(name: str, w: WorkerConfig, cfg: ClusterConfig, model: str, secret: str) -> ProcSpec:
    role = name.rsplit("-", 1)[0]
    peers = {"prefill": cfg.decode, "decode": cfg.prefill}.get(role, [])
    config = WorkerServeConfig(
        role=role,
        model=model,
        worker=w.model_copy(update={"engine_id": w.engine_id or f"{name}-{w.port}"}),
        transfer=cfg.transfer,
        peers=[p.advertised_url() for p in peers],  # what their KV handles' metadata URLs say
        cluster_secret=secret,
    )
    pin = plan_pinning(w.numa_node, w.gpus, w.cpus)
    env = {**cfg.transfer.env(), "CUDA_VISIBLE_DEVICES": ",".join(map(str, w.gpus))}
    if w.device == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # GPU indices as NVML and sysfs number them
    if pin.cpus and "OMP_NUM_THREADS" not in os.environ:
        # torch's default counts every core, not ours; the worker's ranks share its cores
        env["OMP_NUM_THREADS"] = str(max(1, len(pin.cpus) // w.tp_size))
    return ProcSpec(name, role, w.host, w.port, config, env, pin, list(w.gpus), restart=w.restart)


def router_spec(cfg: ClusterConfig, model: str, secret: str) -> ProcSpec:
    r = cfg.router
    config = RouterServeConfig(
        role="router",
        model=model,
        served_model_name=cfg.served_model_name,
        router=r,
        prefill=[_worker_url(w) for w in cfg.prefill],
        decode=[_worker_url(w) for w in cfg.decode],
        colocated=[_worker_url(w) for w in cfg.colocated],
        cluster_secret=secret,
    )
    auth = {"Authorization": f"Bearer {r.api_key}"} if r.api_key else {}
    return ProcSpec(
        "router",
        "router",
        r.host,
        r.port,
        config,
        {"CUDA_VISIBLE_DEVICES": ""},
        PinPlan("none", None, (), "router"),
        headers=auth,
        restart=r.restart,
    )


def plan(cfg: ClusterConfig, model: str) -> list[ProcSpec]:
    """Every process to start, workers first, router last."""
    secret = cfg.cluster_secret or secrets.token_hex(16)
    workers = [worker_spec(name, w, cfg, model, secret) for name, w in cfg.named_workers()]
    return workers + [router_spec(cfg, model, secret)]


def port_free(host: str, port: int) -> bool:
    """Can a server bind (host, port) now? (SO_REUSEADDR as uvicorn sets it.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def write_serve_config(spec: ProcSpec, folder: Path) -> Path:
    """The child's ServeConfig as JSON, readable by this user only (it holds the cluster secret)."""
    path = folder / f"{spec.name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(spec.config.model_dump_json(indent=1))
    os.chmod(path, 0o600)  # an older file of another mode keeps its mode through O_TRUNC
    return path
