"""Transfer backends by name, each built from the same settings plus its own options.

`nixl` is the one backend a cluster config or the CLI can name; it is imported only when asked
for (it loads UCX at import). The in-process fake (fake_connector.py) is for unit tests, which
build it directly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.disagg.base import KVConnector
from pdserve.disagg.options import ConnectorRole, StagingOptions

TransferBackend = Literal["nixl"]


class ConnectorSettings(BaseModel):
    """What every backend takes; `options` are the backend's own (validated by its Options model)."""

    model_config = ConfigDict(extra="forbid")

    model_id: str  # what the compatibility hash calls the model
    metadata_url: str = ""  # where this worker serves peer_metadata() (goes into its KV handles)
    lease_s: float = Field(60.0, gt=0)
    transfer_timeout_s: float = Field(30.0, gt=0)
    lease_margin_s: float = Field(1.0, ge=0)
    role: ConnectorRole = "both"  # which arena it needs: prefill staging, decode landing, or both
    staging: StagingOptions = Field(default_factory=StagingOptions)
    verify: bool = True  # checksum leased KV, check it where it lands (checksum.py)
    options: dict[str, Any] = Field(default_factory=dict)


def make_connector(backend: TransferBackend, engine_id: str, settings: ConnectorSettings) -> KVConnector:
    if backend != "nixl":
        raise ValueError(f"unknown transfer backend {backend!r}; the one backend is 'nixl'")
    from pdserve.disagg.nixl.connector import NixlConnector, NixlOptions

    options = NixlOptions.model_validate(settings.options)
    common = {k: v for k, v in settings if k != "options"}  # StagingOptions stays a model
    return NixlConnector(engine_id, **common, **options.model_dump())
