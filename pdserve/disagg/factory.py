"""Transfer backends by name. `nixl` is imported only when asked for (it loads UCX at import)."""

from __future__ import annotations

from typing import Any, Literal

from pdserve.disagg.base import KVConnector

BACKENDS = ("nixl", "fake")


def make_connector(name: Literal["nixl", "fake"], engine_id: str, *, model_id: str, **kwargs: Any) -> KVConnector:
    """Build a worker's connector. kwargs: metadata_url, lease_s, transfer_timeout_s, lease_margin_s,
    version; nixl also metadata_timeout_s, allowed_peers, metadata_headers; fake also fabric."""
    if name == "nixl":
        from pdserve.disagg.nixl_connector import NixlConnector

        return NixlConnector(engine_id, model_id=model_id, **kwargs)
    if name == "fake":
        from pdserve.disagg.fake_connector import FakeConnector

        return FakeConnector(engine_id, model_id=model_id, **kwargs)
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
