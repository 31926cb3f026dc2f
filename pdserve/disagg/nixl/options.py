"""NixlOptions: the nixl backend's own settings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class NixlOptions(BaseModel):
    """The nixl backend's own settings (ConnectorSettings.options; transfer.options in a cluster YAML)."""

    model_config = ConfigDict(extra="forbid")

    # NIXL's own UCX progress thread, which busy-polls most of a core per worker. Off, transfers
    # advance when the engine loop polls them (a decode engine with loads in flight polls during
    # its steps too) and, on a prefill worker, from progress_interval_ms.
    progress_thread: bool = False
    # prefill workers without it: a thread progresses UCX (and collects release messages) this
    # often, so decode's READs complete during prefill's steps too; 0: only when the engine polls
    progress_interval_ms: float = Field(1.0, ge=0)
    # a pool on the GPU: set the UCX defaults (ucx_env.py) where the environment does not
    ucx_gpu_defaults: bool = True
    # pools on GPUs of one host: decode maps the prefill pool through CUDA IPC and copies a
    # request's blocks itself (cuda_ipc.py); off: every request is read over NIXL
    cuda_ipc: bool = True
