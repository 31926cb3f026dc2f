"""PD disaggregation: the KV transfer interface (base), its backends (nixl, fake) and their helpers.

The nixl backend is not imported here: `make_connector("nixl", ...)` imports it when asked."""

from pdserve.disagg.base import KVConnector, KVHandle, TransferError, TransferStage
from pdserve.disagg.factory import make_connector
from pdserve.disagg.layout import KVLayout, compat_hash
from pdserve.disagg.lease import LeaseTable, TransferStats

__all__ = [
    "KVConnector",
    "KVHandle",
    "KVLayout",
    "LeaseTable",
    "TransferError",
    "TransferStage",
    "TransferStats",
    "compat_hash",
    "make_connector",
]
