"""Assemble one worker from its validated config: connector, engine, async loop, HTTP app.

    WorkerServeConfig -> make_connector (prefill, decode) -> LLMEngine -> AsyncEngine -> build_worker_app

The model is loaded here, before the port is bound, so a port that answers is a worker that can
serve. A worker whose engine fails exits (failure.py) for its supervisor to restart. On loopback
the transfer listeners stay on loopback too (UCX_NET_DEVICES=lo unless set).
KV handles carry the advertised address (`advertise_host`, not the bind address): the metadata URL a
decode worker on another host fetches.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import logging
import os
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdserve import __version__
from pdserve.config import LOOPBACK
from pdserve.disagg.base import KVConnector
from pdserve.disagg.factory import ConnectorSettings, make_connector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serve_config import WorkerServeConfig
from pdserve.wire.protocol import SECRET_HEADER, WorkerInfo
from pdserve.worker.app import WorkerState, build_worker_app
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.drain import Drain
from pdserve.worker.failure import exit_process, watch_engine
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.peers import PeerMetadataFetcher

log = logging.getLogger("pdserve.worker")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "colocated": "kv_both"}


def build_worker(cfg: WorkerServeConfig) -> FastAPI:
    w, t = cfg.worker, cfg.transfer
    # the connector's arenas are made after the pool is sized: keep them out of its budget
    # a decode worker's prefix cache reuses blocks its loads would move (engine/prefix_cache.py)
    update = {"reserved_memory_mib": arena_mib(cfg), "kv_role": KV_ROLES[cfg.role]}
    engine_config = w.engine_config(cfg.model).model_copy(update=update)
    connector = _connector(cfg) if cfg.role != "colocated" else None
    log.info("loading %s on %s for role %s", cfg.model, w.device, cfg.role)
    engine = LLMEngine(
        engine_config, connector, kv_load_failure_policy=t.kv_load_failure_policy, handoff_timeout_s=t.handoff_timeout
    )
    headers = {SECRET_HEADER: cfg.cluster_secret} if cfg.cluster_secret else None
    info = worker_info(cfg, engine, connector)
    metrics = WorkerMetrics()
    async_engine = AsyncEngine(engine, metrics, stall_s=w.stall_timeout)
    state = WorkerState(
        engine=async_engine,
        info=info,
        metrics=metrics,
        max_open_requests=w.max_open_requests or max(8 * engine_config.max_num_seqs, 256),
        drain=Drain(async_engine, w.drain_timeout),
        kv_metadata=connector.peer_metadata() if connector is not None else None,
        # the handshake is part of the transfer's time: never longer than the transfer timeout.
        # decode: its prefill peers'; prefill: its decode peers' (to hand off to them directly)
        peers=PeerMetadataFetcher(cfg.peers, min(t.metadata_timeout, t.timeout), headers)
        if connector is not None and cfg.peers
        else None,
    )
    app = build_worker_app(state, cfg.cluster_secret)
    app.state.exit_code = 0  # set when the engine failed (failure.py): what `pdserve serve` exits with
    stopping = threading.Event()
    app.state.on_exit = stopping.set  # serve.py calls it on a stop signal: ranks that die now are stopping too
    app.state.drain = state.drain  # server.py: a stop signal drains the worker first
    app.router.lifespan_context = _lifespan(state, connector, stopping)
    return app


def worker_info(cfg: WorkerServeConfig, engine: LLMEngine, connector: KVConnector | None) -> WorkerInfo:
    """What /internal/info tells the router and the peers about this worker."""
    engine_config, t = engine.config, cfg.transfer
    return WorkerInfo(
        role=cfg.role,
        engine_id=cfg.engine_id,
        model=os.path.basename(os.path.abspath(cfg.model)),
        max_model_len=engine.max_model_len,
        kv_block_size=engine_config.kv_block_size,
        num_kv_blocks=engine.num_kv_blocks,
        max_num_seqs=engine_config.max_num_seqs,
        device=engine_config.device,
        dtype=engine_config.resolved_dtype(),
        transfer_backend=t.backend if connector is not None else None,
        instance_id=connector.instance_id if connector is not None else None,
        kv_metadata_url=connector.metadata_url if connector is not None else None,
        gpus=_gpu_ids(engine_config.device, engine_config.tensor_parallel_size),
        prefix_caching=engine.block_manager.prefix_cache is not None,
        pdserve_version=__version__,
    )


def arena_mib(cfg: WorkerServeConfig) -> int:
    """Device memory (MiB) the worker's staged-transfer arena will take: prefill's staging arena or
    decode's landing arena when staging is on for a GPU pool (disagg/staging.py), else 0."""
    if cfg.role == "colocated" or not cfg.worker.device.startswith("cuda"):
        return 0
    return sum(cfg.transfer.staging.arenas_mib(cfg.role, on_gpu=True))


def _connector(cfg: WorkerServeConfig) -> KVConnector:
    w, t = cfg.worker, cfg.transfer
    if w.host in LOOPBACK or _is_loopback(w.advertised()):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX listens on every interface otherwise
    settings = ConnectorSettings(
        model_id=_model_id(cfg.model),
        metadata_url=f"{w.advertised_url()}/internal/kv_metadata",
        lease_s=w.lease_seconds,
        transfer_timeout_s=t.timeout,
        role=cfg.role,
        staging=t.staging,
        verify=t.verify,
        options=t.options,
    )
    return make_connector(t.backend, cfg.engine_id, settings)


def _gpu_ids(device: str, tp_size: int) -> list[str]:
    """UUIDs of the GPUs the worker's ranks use: what tells two processes on one GPU from two GPUs
    (`pdserve bench` counts a deployment's GPUs by them)."""
    if not device.startswith("cuda"):
        return []
    import torch

    from pdserve.distributed.group import rank_device

    props = [torch.cuda.get_device_properties(rank_device(device, r)) for r in range(tp_size)]
    return [str(getattr(p, "uuid", None) or f"{p.name} #{rank_device(device, r).index}") for r, p in enumerate(props)]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _lifespan(state: WorkerState, connector: KVConnector | None, stopping: threading.Event):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        on_failure = functools.partial(exit_process, app)
        watch = asyncio.create_task(watch_engine(state.engine, state.info.role, on_failure, stopping))
        try:
            yield
        finally:
            watch.cancel()
            state.engine.stop(timeout_s=2.0 if state.engine.error else 10.0)  # failed: its thread may never return
            state.engine.shutdown()  # tensor-parallel ranks
            if state.peers is not None:
                await state.peers.aclose()
            if connector is not None:
                connector.shutdown()

    return lifespan


def _model_id(model_dir: str) -> str:
    """What the KV compatibility hash calls the model: a digest of its config.json (the same
    checkpoint at different paths on different hosts must match)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return "config-sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]
