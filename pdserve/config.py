"""Configuration, one path for all of it: validated pydantic models with clear messages.

    cluster YAML (configs/*.yaml) -> ClusterConfig --pdserve launch--> one ServeConfig per process
    pdserve serve --flags ----------------------------------------> ServeConfig (same models)
    ServeConfig -> WorkerServeConfig (prefill | decode | colocated) or RouterServeConfig (serve_config.py)

`pdserve launch` hands each child its ServeConfig as a JSON file (mode 0600: secrets never appear
in argv). Defaults and limits live here and nowhere else; `load_config` takes a path or a name in configs/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.disagg.factory import StagingOptions, TransferBackend
from pdserve.engine.config import (
    DType,
    EngineConfig,
    Fp4MoEBackend,
    KVCacheDType,
    KVLoadFailurePolicy,
    LoadFormat,
    Quantization,
    check_device,
)
from pdserve.engine.spec_decode.config import MTP_PAIR, SPEC_ON_PREFILL, SpeculativeConfig

# configs/ sits beside the package in the source tree (the repo is installed editable).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "tiny-cpu"
TINY_ARCHS = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
TINY_PREFIX = "tiny:"  # model "tiny:<arch>": the tiny random checkpoint, made in the cache on first use
# What the tiny writer makes, stamped in each cached folder: a cached model of another format (an older
# pdserve's, e.g. a V4 tokenizer without V4's chat tokens) is made anew on its next use.
TINY_FORMAT = 4  # 3: V3 / V3.2 with their MTP layer; 4: V4 with its MTP layer
TINY_STAMP = "pdserve_tiny.json"


def default_served_name(model: str) -> str | None:
    """The name clients use when served_model_name is not set: tiny:deepseek_v4 ->
    tiny-deepseek-v4; None for a folder (the router serves it under the path as given)."""
    if model.startswith(TINY_PREFIX):
        return "tiny-" + model.removeprefix(TINY_PREFIX).replace("_", "-")
    return None


WorkerRole = Literal["prefill", "decode", "colocated"]
PolicyName = Literal["round_robin", "least_load", "power_of_two", "cache_aware"]  # router/policies.py
PrefillPolicyName = Literal["auto", "round_robin", "least_load", "power_of_two", "cache_aware"]
DEFAULT_PORTS = {"router": 8000, "prefill": 30000, "decode": 30001, "colocated": 30002}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RestartPolicy = Literal["on-failure", "always", "never"]  # what `pdserve launch` does when the process exits


class ConfigError(ValueError):
    """A config that cannot be found, parsed or validated; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


WILDCARD = ("0.0.0.0", "::", "")

ReasoningParser = Literal["auto", "none", "deepseek_v4", "deepseek_r1"]
ToolCallParser = Literal["auto", "none", "deepseek_v4", "deepseek_v32", "deepseek_v31", "deepseek_v3"]


class CacheAwareSettings(_Strict):
    """The cache_aware policy (router/cache_aware.py); sgl-router's names and meanings."""

    cache_threshold: float = Field(0.5, ge=0, le=1)  # share of the prompt a worker must hold to win on cache
    # Out of balance, by requests in flight: max - min > abs AND max > rel x min -> the least loaded
    # worker, whatever it holds. A prefill worker's in-flight requests are its queue of prompts.
    balance_abs_threshold: int = Field(8, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(1 << 20, ge=16)  # prompt tokens remembered per worker (LRU beyond)


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_server_count: int = Field(1, ge=1, le=64)  # router processes sharing the port (vLLM's --api-server-count)
    # auto: cache_aware among several prefill workers that all keep a prefix cache, else round_robin
    prefill_policy: PrefillPolicyName = "auto"
    decode_policy: PolicyName = "least_load"
    cache_aware: CacheAwareSettings = Field(default_factory=CacheAwareSettings)  # the cache_aware policy's knobs
    api_key: str | None = None  # clients must send Authorization: Bearer <key> (every route)
    max_model_len: int | None = Field(None, ge=2)  # an extra cap on the workers' context length
    # chat_template_kwargs a chat request gets unless it sets them (e.g. {"thinking": true})
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    health_interval: float = Field(2.0, gt=0)  # seconds between worker probes
    request_timeout: float = Field(600.0, gt=0)  # seconds a request may take in all (then 504)
    first_token_timeout: float = Field(300.0, gt=0)  # seconds until a request's first token
    prefill_timeout: float = Field(300.0, gt=0)  # seconds a prefill worker has for first token + KV
    max_queued_requests: int = Field(1024, ge=1)  # concurrent requests before 429
    max_attempts: int = Field(3, ge=1)  # workers of a role tried when one refuses, before output
    migration_limit: int = Field(3, ge=0)  # times a request moves on when its worker fails mid-request (Dynamo's name)
    retry_backoff: float = Field(0.05, ge=0)  # seconds before the second try; doubles each try
    breaker_failures: int = Field(5, ge=1)  # consecutive failed requests that open a worker's breaker
    breaker_cooldown: float = Field(10.0, gt=0)  # seconds an open breaker waits before a trial
    restart: RestartPolicy = "on-failure"  # launch: restart the router when it dies
    reasoning_parser: ReasoningParser = "auto"  # reasoning_content apart; auto: by the model (chat/parsers)
    tool_call_parser: ToolCallParser = "auto"  # tool calls out of the model's markup; auto: by the model
    chat_encoder_revision: Literal["auto", "original", "0731"] = "auto"  # V4's effort texts (chat/dsv4_revision.py)


class WorkerConfig(_Strict):
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"  # bind address
    advertise_host: str | None = None  # where other hosts reach it (KV handles, metadata URL); default: advertised()
    device: str = "cpu"  # cpu | cuda (launch: with gpus) | cuda:N (serve)
    gpus: list[int] = Field(default_factory=list)
    tp_size: int = Field(1, ge=1)  # the worker's tensor_parallel_size: one rank per GPU of gpus; on cpu, gloo processes
    numa_node: int | Literal["auto"] | None = None  # None: not pinned; auto: its GPUs' node
    cpus: str | None = None  # narrow the node to these CPUs, a cpulist such as "0-7"
    dtype: DType = "auto"
    load_format: LoadFormat = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    kv_block_size: int = Field(64, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    # cuda: the share of the whole GPU this worker may use (weights + peak activations + KV pool;
    # vLLM's meaning: two workers on one GPU at 0.45 each); the pool is planned at start
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    async_scheduling: bool | None = None  # the overlapped engine loop (None: on CUDA; engine/config.py)
    enable_prefix_caching: bool = True  # reuse cached KV blocks of earlier prompts (docs/prefix-caching.md)
    kv_cache_dtype: KVCacheDType = "auto"  # fp8: FP8 latent records (V3 / V3.2); part of the KV compatibility hash
    quantization: Quantization | None = None  # weights: unset follows the checkpoint (FP8 kept FP8); none dequantizes
    fp4_moe_backend: Fp4MoEBackend = "auto"  # FP4 experts' kernel path (engine/config.py)
    cuda_graph_max_bs: int | None = Field(None, ge=1)  # largest decode batch captured (default min(max_num_seqs, 256))
    speculative_config: SpeculativeConfig | None = None  # vLLM's: {"method": "ngram", "num_speculative_tokens": k, ...}
    lease_seconds: float = Field(60.0, gt=0)  # prefill keeps KV this long for decode to pull
    engine_id: str | None = None  # default: "<role>-<index>-<port>" (launch), "<role>-<port>" (serve)
    max_open_requests: int | None = Field(
        None, ge=1
    )  # admitted at once before 429 (default max(8 x max_num_seqs, 256))
    restart: RestartPolicy = "on-failure"  # launch: restart this worker when it dies
    drain_timeout: float = Field(30.0, ge=0)  # SIGTERM: seconds serving the open requests before exit (drain.py)
    stall_timeout: float = Field(60.0, gt=0)  # no finished step this long, requests open: /health 503 (TP > 1: exit)

    @field_validator("device")
    @classmethod
    def _device(cls, d: str) -> str:
        return check_device(d)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, gpus: list[int]) -> list[int]:
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus must be distinct non-negative GPU indices, got {gpus}")
        return gpus

    @field_validator("numa_node")
    @classmethod
    def _numa(cls, node: int | str | None) -> int | str | None:
        if isinstance(node, int) and node < 0:
            raise ValueError(f"numa_node must be >= 0, 'auto' or null, got {node}")
        return node

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, cpus: str | None) -> str | None:
        if cpus is not None:
            from pdserve.numa import parse_cpulist

            if not parse_cpulist(cpus):
                raise ValueError("cpus must name at least one CPU, e.g. '0-7'")
        return cpus

    @model_validator(mode="after")
    def _placement(self) -> WorkerConfig:
        if self.device == "cpu":
            if self.gpus:
                raise ValueError(f"a cpu worker takes no gpus (got {self.gpus}); set device: cuda")
            if self.numa_node == "auto":
                raise ValueError("numa_node 'auto' follows the worker's GPUs; a cpu worker needs a node number or null")
        elif self.gpus:
            if self.device != "cuda":
                raise ValueError("gpus picks the worker's GPUs: set device: cuda (not cuda:N) with them")
            if self.tp_size != len(self.gpus):
                raise ValueError(f"tp_size ({self.tp_size}) must equal the number of gpus ({self.gpus})")
        if self.cpus is not None and self.numa_node is None:
            raise ValueError("cpus narrows a NUMA node: set numa_node too")
        return self

    def advertised(self) -> str:
        """The address peers use for this worker: advertise_host, else the bind host, else (bound
        to every address) this host's name."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in WILDCARD:
            import socket

            return socket.gethostname()
        return self.host

    def advertised_url(self) -> str:
        host = self.advertised()
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def engine_config(self, model: str) -> EngineConfig:
        return EngineConfig(
            model=model,
            device=self.device,
            tensor_parallel_size=self.tp_size,
            dtype=self.dtype,
            load_format=self.load_format,
            kv_block_size=self.kv_block_size,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            fp4_moe_backend=self.fp4_moe_backend,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            speculative_config=self.speculative_config,
            **({"max_num_batched_tokens": self.max_num_batched_tokens} if self.max_num_batched_tokens else {}),
        )


class TransferConfig(_Strict):
    backend: TransferBackend = "nixl"
    timeout: float = Field(30.0, gt=0)  # seconds for one request's KV pull
    metadata_timeout: float = Field(5.0, gt=0)  # seconds for a worker to fetch a PD peer's metadata
    handoff_timeout: float = Field(
        300.0, gt=0
    )  # decode: seconds a request sent with its prefill waits for the hand-off
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"  # decode: a failed read fails the request, or recomputes it
    options: dict[str, Any] = Field(default_factory=dict)  # the backend's own (nixl: progress_thread)
    staging: StagingOptions = Field(default_factory=StagingOptions)  # staged transfer: mode, arena MiB
    verify: bool = True  # prefill checksums the KV it leases, decode checks what it read (disagg/checksum.py)
    ucx: dict[str, str | int | float] = Field(default_factory=dict)  # UCX_* env for the workers

    @field_validator("ucx")
    @classmethod
    def _ucx(cls, env: dict[str, str | int | float]) -> dict[str, str | int | float]:
        bad = [k for k in env if not k.startswith("UCX_")]
        if bad:
            raise ValueError(f"transfer.ucx holds UCX_* environment variables only; not: {bad}")
        return env

    def env(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.ucx.items()}


class ClusterConfig(_Strict):
    model: str  # checkpoint folder, or "tiny:<arch>"
    served_model_name: str | None = None
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: list[WorkerConfig] = Field(default_factory=list)
    decode: list[WorkerConfig] = Field(default_factory=list)
    colocated: list[WorkerConfig] = Field(default_factory=list)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    cluster_secret: str | None = None  # shared by router and workers; None: a fresh one per launch
    log_dir: str | None = None  # None: a new folder per launch under <cache>/logs (kept)
    startup_timeout: float = Field(900.0, gt=0)  # seconds for every process to report healthy
    stop_grace_seconds: float = Field(10.0, gt=0)  # SIGTERM, then SIGKILL after this long
    max_restarts: int = Field(5, ge=0)  # restarts of one process within restart_window before launch gives up on it
    restart_window: float = Field(300.0, gt=0)  # seconds
    restart_backoff: float = Field(
        1.0, ge=0
    )  # seconds before the first restart; doubles with each restart in the window
    max_restart_backoff: float = Field(30.0, ge=0)

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        if not model.strip():
            raise ValueError("model must be a checkpoint folder or 'tiny:<arch>'")
        if model.startswith(TINY_PREFIX) and model[len(TINY_PREFIX) :] not in TINY_ARCHS:
            raise ValueError(f"unknown tiny model {model!r}; choose one of {[TINY_PREFIX + a for a in TINY_ARCHS]}")
        return model

    @model_validator(mode="after")
    def _topology(self) -> ClusterConfig:
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD needs both prefill and decode workers (or use colocated workers only)")
        if not self.prefill and not self.colocated:
            raise ValueError("no workers: list prefill + decode workers, colocated workers, or both")
        seen: dict[int, str] = {self.router.port: "router"}
        for name, w in self.named_workers():
            if w.speculative_config is not None and w.speculative_config.method != "mtp" and name.startswith("prefill"):
                raise ValueError(f"{name}: {SPEC_ON_PREFILL}")
            if w.device.startswith("cuda") and not w.gpus:
                raise ValueError(f"{name}: a cuda worker needs gpus, e.g. gpus: [0] (launch gives it exactly those)")
            if w.port in seen:
                raise ValueError(f"port {w.port} is used by both {seen[w.port]} and {name}")
            seen[w.port] = name
        pd = {name: _mtp(w) for name, w in self.named_workers() if not name.startswith("colocated")}
        if any(pd.values()) and not all(pd.values()):  # the router pairs any prefill with any decode
            raise ValueError(f"{', '.join(n for n, m in pd.items() if not m)}: {MTP_PAIR}")
        return self

    def named_workers(self) -> list[tuple[str, WorkerConfig]]:
        """('prefill-0', cfg), ..., ('decode-0', cfg), ..., ('colocated-0', cfg), ..."""
        groups = (("prefill", self.prefill), ("decode", self.decode), ("colocated", self.colocated))
        return [(f"{role}-{i}", w) for role, workers in groups for i, w in enumerate(workers)]


def _mtp(w: WorkerConfig) -> bool:
    return w.speculative_config is not None and w.speculative_config.method == "mtp"


def cache_dir() -> Path:
    """Where pdserve keeps what it makes: tiny checkpoints, launch logs ($PDSERVE_CACHE, else ~/.cache/pdserve)."""
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def resolve_model(spec: str) -> str:
    """A checkpoint folder, or 'tiny:<arch>' -> the tiny model in the cache (<cache>/tiny-<arch>-seed0),
    made on first use. Everything that takes a model folder takes this: launch, serve, LLM."""
    if not spec.startswith(TINY_PREFIX):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ConfigError(
                f"model folder {spec!r} has no config.json (pass a checkpoint folder or 'tiny:deepseek_v3')"
            )
        return os.path.abspath(spec)
    arch = spec[len(TINY_PREFIX) :]
    if arch not in TINY_ARCHS:
        raise ConfigError(f"unknown tiny model {spec!r}; choose one of {[TINY_PREFIX + a for a in TINY_ARCHS]}")
    target = cache_dir() / f"tiny-{arch}-seed0"
    stamp = {"format": TINY_FORMAT, "arch": arch, "seed": 0}
    if _read_json(target / TINY_STAMP) != stamp:
        from pdserve.tiny_model import make_tiny_model

        print(f"making the tiny {arch} model in {target}", flush=True)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        make_tiny_model(str(tmp), arch, 0)
        (tmp / TINY_STAMP).write_text(json.dumps(stamp))
        if target.exists():  # another format: moved aside at once, removed after
            old = target.with_name(f"{target.name}.old-{os.getpid()}")
            with contextlib.suppress(OSError):
                target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)  # atomic: a concurrent maker sees all of it or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another one made it first
    return str(target)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def find_config(name_or_path: str) -> Path:
    """A path as given, else configs/<name> or configs/<name>.yaml."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"config {name_or_path!r} not found (not a file; shipped configs in {CONFIG_DIR}: {known})")


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is not a valid pdserve config:\n{_format_errors(err)}") from None


def load_config(name_or_path: str = DEFAULT_CONFIG) -> ClusterConfig:
    path = find_config(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_config(data, str(path))
