"""Transfer settings every connector takes, importable without torch (the CLI and the config
validate them before any model or pool exists)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ConnectorRole = Literal["prefill", "decode", "both"]


class StagingOptions(BaseModel):
    """Staged transfer (staging.py): the prefill side gathers a request's blocks into a slab of its
    staging arena, the decode side reads it with one descriptor into its landing arena and scatters.
    A request that finds no room in either arena moves as per-block descriptors (counted)."""

    model_config = ConfigDict(extra="forbid")

    # auto: on for pools on the GPU (one descriptor a request instead of one per region, layer and
    # run), off on CPU
    mode: Literal["auto", "on", "off"] = "auto"
    prefill_arena_mib: int = Field(1024, ge=0)  # a prefill worker's staging arena, on the pool's device
    decode_arena_mib: int = Field(1024, ge=0)  # a decode worker's landing arena

    def enabled(self, on_gpu: bool) -> bool:
        return self.mode == "on" or (self.mode == "auto" and on_gpu)

    def arenas_mib(self, role: ConnectorRole, on_gpu: bool) -> tuple[int, int]:
        """(staging, landing) arena MiB a connector of `role` makes for a pool (0: none)."""
        if not self.enabled(on_gpu):
            return 0, 0
        return (self.prefill_arena_mib if role != "decode" else 0), (self.decode_arena_mib if role != "prefill" else 0)
