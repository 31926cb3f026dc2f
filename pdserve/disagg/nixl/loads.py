"""A decode worker's in-flight loads: one object per request, of the transport that moves its KV.

    NothingToRead  the request needs no block: prefill was told at once           path "none"
    BlockRead      a NIXL READ of the request's blocks, one descriptor per
                   (region, layer, run)                                           path "blocks"
    StagedRead     a NIXL READ of prefill's gathered slab into landing room,
                   then scattered into the blocks (staging.py)                    path "staged"
    IpcCopy        a copy out of a same-host prefill pool mapped through CUDA
                   IPC (cuda_ipc.py)                                              path "cuda_ipc"

The connector drives each the same way (NixlConnector.poll_loads):

    poll()     advance it: marks it finished, or returns why it failed (peer_gone: the peer is gone)
    done()     once finished: let go of the transport; True when prefill is to be told now that it
               may free its blocks (NothingToRead told it at post)
    land()     the bytes into the pool's blocks where they did not arrive there (a staged slab);
               raises when they could not be
    cancel()   stop it and free what it holds here (a READ's handle, landing room)
    settled()  nothing of it still reads the peer's blocks: only then may prefill free them

Failures are reasons (strings) here; the connector turns them into TransferError (stage READING).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pdserve.disagg.base import KVHandle
from pdserve.disagg.cuda_ipc import CopyInFlight
from pdserve.disagg.nixl.agent import NixlAgent, is_disconnect, nixl_reason

log = logging.getLogger("pdserve.disagg.nixl")


@dataclass(kw_only=True)
class Load:
    handle: KVHandle
    agent_name: str  # the prefill engine's NIXL agent (where the release message goes)
    started: float  # monotonic, at post
    timeout_s: float  # the transfer timeout it was posted under
    nbytes: int = 0  # KV bytes it moves
    num_descs: int = 0  # NIXL descriptors posted
    finished_at: float | None = None  # wall clock when it was seen complete (against the lease)
    seconds: float = 0.0  # post to completion (to landed, for a staged read)
    peer_gone: bool = False  # poll() saw the peer disconnect: the connector forgets it

    path: ClassVar[str] = "none"  # how it moved its bytes: TransferStats.paths, pdserve_kv_transfer_path_total

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def finish(self) -> None:
        self.finished_at = time.time()
        self.seconds = time.monotonic() - self.started

    def poll(self) -> str | None:
        return None

    def done(self) -> bool:
        return True

    def land(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def settled(self) -> bool:
        return True


@dataclass(kw_only=True)
class NothingToRead(Load):
    """No region needs a block: finished at post, and prefill was told then to free its lease."""

    def __post_init__(self) -> None:
        self.finish()

    def done(self) -> bool:
        return False


@dataclass(kw_only=True)
class BlockRead(Load):
    agent: NixlAgent
    xfer: object  # nixl_xfer_handle
    path: ClassVar[str] = "blocks"

    def poll(self) -> str | None:
        engine_id = self.handle.engine_id
        try:
            state = self.agent.state(self.xfer)
        except Exception as e:
            self.peer_gone = is_disconnect(e)
            return f"reading from {engine_id}: {nixl_reason(e)}"
        if state == "ERR":
            self.peer_gone = True
            return f"remote {engine_id} failed the READ (state ERR; disconnected?)"
        if state == "DONE":
            self.finish()
        elif time.monotonic() > self.deadline:
            return f"no completion within {self.timeout_s} s"
        return None

    def done(self) -> bool:
        self.agent.release(self.xfer)
        return True

    def cancel(self) -> None:
        self.agent.release(self.xfer)  # cancels the READ if it is still active


@dataclass(kw_only=True)
class StagedRead(BlockRead):
    """The slab read into [landing, landing + slab bytes) of the landing arena, then scattered
    into local_blocks. The room is freed only once NIXL has let go of the READ."""

    landing: int  # the room's offset in the landing arena
    local_blocks: dict[str, list[int]]  # per region, where the slab's blocks go
    scatter: Callable[[int, int, dict[str, list[int]]], None]  # (offset, nbytes, blocks): lands and frees the room
    free_room: Callable[[int], None]  # frees the room unread
    path: ClassVar[str] = "staged"

    def land(self) -> None:
        self.scatter(self.landing, self.handle.staged.nbytes, self.local_blocks)
        self.seconds = time.monotonic() - self.started

    def cancel(self) -> None:
        self.agent.release(self.xfer, lambda: self.free_room(self.landing))


@dataclass(kw_only=True)
class IpcCopy(Load):
    """A copy queued on the decode worker's copy stream, reading the mapped peer pool."""

    copy: CopyInFlight
    settle_s: float  # how long a cancelled or failed copy is waited for before prefill may free its blocks
    path: ClassVar[str] = "cuda_ipc"

    def __post_init__(self) -> None:
        if self.copy.query():
            self.finish()

    def poll(self) -> str | None:
        if self.copy.query():
            self.finish()
        elif time.monotonic() > self.deadline:
            return f"the copy from {self.handle.engine_id}'s mapped pool did not finish within {self.timeout_s} s"
        return None

    def settled(self) -> bool:
        """Waits briefly for a copy still running; one still running after that is left to the lease."""
        if self.copy.wait(self.settle_s):
            return True
        log.error(
            "request %s: the copy from %s's pool is still running after %g s; its blocks are freed at lease expiry",
            self.handle.request_id, self.handle.engine_id, self.settle_s,
        )  # fmt: skip
        return False
