"""Transfer counters a connector keeps and its worker exports as metrics. Plain Python, no torch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadRecord:
    """One finished KV read (decode side): what it moved and when, on this process's monotonic clock."""

    request_id: str
    nbytes: int
    started: float  # time.monotonic() when the read was posted
    seconds: float  # post to completion
    descriptors: int
    nbytes_saved: int = 0  # KV bytes it did not move: blocks the decode worker's prefix cache held

    @property
    def finished(self) -> float:
        return self.started + self.seconds


@dataclass
class TransferStats:
    """Counters a worker exports as metrics. Decode side: loads; prefill side: leases."""

    bytes_transferred: int = 0
    bytes_saved: int = 0  # decode: KV bytes not moved because the prefix cache held those blocks
    transfers_done: int = 0
    transfers_failed: int = 0
    transfer_seconds_sum: float = 0.0
    recent_loads: deque[LoadRecord] = field(default_factory=lambda: deque(maxlen=1024))  # the latest, oldest first
    descriptors_sum: int = 0  # NIXL descriptors over all transfers (descriptors per request = this / done)
    failures_by_stage: dict[str, int] = field(default_factory=dict)
    leases_released: int = 0  # by a decode notification or an explicit release
    lease_expirations: int = 0
    control_failures: dict[str, int] = field(default_factory=dict)  # notify / drop_peer calls that raised
    # staged transfer (staging.py), by (side, result): prefill gathers ("staged" | "arena_full"),
    # decode reads ("staged" | "arena_full": no landing room | "not_staged": the handle has no slab)
    staged: dict[tuple[str, str], int] = field(default_factory=dict)
    stage_seconds_sum: float = 0.0  # prefill: gathers, decode: scatters (device time, synchronized)
    handoffs: dict[str, float] = field(default_factory=dict)  # decode: request id -> when its hand-off came
    # decode: finished loads by how the bytes moved: "cuda_ipc" (copied from a same-host pool),
    # "staged" (one slab READ), "blocks" (a descriptor per region, layer and run), "none" (no bytes)
    paths: dict[str, int] = field(default_factory=dict)
    # decode, verified hand-off (checksum.py): loads whose blocks matched prefill's checksums, reads
    # that did not (each read: a re-read counts again), and the checksums' time (synchronized)
    verified_loads: int = 0
    verify_failures: int = 0
    verify_seconds_sum: float = 0.0

    def record_handoff(self, request_id: str, at: float) -> None:
        """Decode: when (monotonic) a request's hand-off arrived; kept for the latest 1,024."""
        self.handoffs[request_id] = at
        while len(self.handoffs) > 1024:
            del self.handoffs[next(iter(self.handoffs))]

    def record_done(self, load: LoadRecord) -> None:
        self.bytes_transferred += load.nbytes
        self.bytes_saved += load.nbytes_saved
        self.transfers_done += 1
        self.transfer_seconds_sum += load.seconds
        self.recent_loads.append(load)
        self.descriptors_sum += load.descriptors

    def load_of(self, request_id: str) -> LoadRecord | None:
        """The request's finished read, if it is among the recent ones (newest searched first)."""
        return next((r for r in reversed(self.recent_loads) if r.request_id == request_id), None)

    def record_failed(self, stage_name: str) -> None:
        self.transfers_failed += 1
        self.failures_by_stage[stage_name] = self.failures_by_stage.get(stage_name, 0) + 1

    def record_staged(self, side: str, result: str, seconds: float = 0.0) -> None:
        key = (side, result)
        self.staged[key] = self.staged.get(key, 0) + 1
        self.stage_seconds_sum += seconds

    def record_verify(self, ok: bool, seconds: float) -> None:
        if ok:
            self.verified_loads += 1
        else:
            self.verify_failures += 1
        self.verify_seconds_sum += seconds

    def record_path(self, path: str) -> None:
        self.paths[path] = self.paths.get(path, 0) + 1

    def record_control_failure(self, what: str) -> None:
        self.control_failures[what] = self.control_failures.get(what, 0) + 1
