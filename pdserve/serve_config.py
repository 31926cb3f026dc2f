"""What one process runs with (`pdserve serve`, or a file `pdserve launch` writes for each child):
a worker's or the router's ServeConfig, built from the cluster config's models (config.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdserve.config import LOOPBACK, RouterConfig, TransferConfig, WorkerConfig, WorkerRole, _Strict
from pdserve.engine.spec_decode.config import SPEC_ON_PREFILL


class WorkerServeConfig(_Strict):
    """One worker process (`pdserve serve --role prefill|decode|colocated`)."""

    role: WorkerRole
    model: str  # checkpoint folder (or tiny:<arch>: `pdserve serve` resolves it before building)
    worker: WorkerConfig
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    peers: list[str] = Field(
        default_factory=list
    )  # workers whose transfer metadata may be fetched (decode: the prefill workers; prefill: the decode workers, to hand off to directly)
    cluster_secret: str | None = None

    @model_validator(mode="after")
    def _safe(self) -> WorkerServeConfig:
        if self.worker.host not in LOOPBACK and not self.cluster_secret:
            raise ValueError(
                f"binding a worker to {self.worker.host} exposes /internal/*: pass --cluster-secret (or bind 127.0.0.1)"
            )
        if self.role == "decode" and not self.peers:
            raise ValueError(
                "a decode worker reads KV only from configured peers: pass --peer URL for each prefill worker"
            )
        spec = self.worker.speculative_config
        if self.role == "prefill" and spec is not None and spec.method != "mtp":
            raise ValueError(SPEC_ON_PREFILL)
        return self

    @property
    def engine_id(self) -> str:
        return self.worker.engine_id or f"{self.role}-{self.worker.port}"


class RouterServeConfig(_Strict):
    """The router process (`pdserve serve --role router`)."""

    role: Literal["router"]
    model: str  # checkpoint folder: the router reads its tokenizer and chat template
    served_model_name: str | None = None  # the model name clients use (default: model as given)
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: list[str] = Field(default_factory=list)  # worker URLs
    decode: list[str] = Field(default_factory=list)
    colocated: list[str] = Field(default_factory=list)
    cluster_secret: str | None = None

    @model_validator(mode="after")
    def _workers(self) -> RouterServeConfig:
        if not (self.prefill or self.decode or self.colocated):
            raise ValueError("the router needs workers: --prefill URL and --decode URL, and/or --colocated URL")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD needs both --prefill and --decode workers")
        return self


ServeConfig = Annotated[WorkerServeConfig | RouterServeConfig, Field(discriminator="role")]
