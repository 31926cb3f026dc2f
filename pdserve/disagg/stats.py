"""Transfer counters a connector keeps and its worker exports as metrics. Plain Python, no torch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """Counters a worker exports as metrics. Decode side: loads; prefill side: leases."""

    bytes_transferred: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    transfer_seconds_sum: float = 0.0
    recent_transfer_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    descriptors_sum: int = 0  # NIXL descriptors over all transfers (descriptors per request = this / done)
    failures_by_stage: dict[str, int] = field(default_factory=dict)
    leases_released: int = 0  # by a decode notification or an explicit release
    lease_expirations: int = 0
    control_failures: dict[str, int] = field(default_factory=dict)  # notify / drop_peer calls that raised

    def record_done(self, nbytes: int, seconds: float, descriptors: int) -> None:
        self.bytes_transferred += nbytes
        self.transfers_done += 1
        self.transfer_seconds_sum += seconds
        self.recent_transfer_seconds.append(seconds)
        self.descriptors_sum += descriptors

    def record_failed(self, stage_name: str) -> None:
        self.transfers_failed += 1
        self.failures_by_stage[stage_name] = self.failures_by_stage.get(stage_name, 0) + 1

    def record_control_failure(self, what: str) -> None:
        self.control_failures[what] = self.control_failures.get(what, 0) + 1
