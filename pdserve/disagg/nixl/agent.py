"""A worker's NIXL agent (UCX backend) and the thread that progresses it.

One agent per worker. The engine loop and, on a prefill worker, a small progress thread share it
under one lock. A decode READ completes only while the prefill side's UCX progresses too (over
cma on CPU as over cuda_ipc on GPUs); a prefill engine polls only between its steps, so without
the thread a READ issued during a long prefill step would wait for the step's end. The thread
progresses UCX every `progress_interval_ms` and sorts the notifications that arrive: release
messages (read by poll_releases) and hand-offs (read by poll_handoffs). NIXL's own progress thread
(`progress_thread`) does the same job but busy-polls a core per worker.

A transfer handle NIXL cannot release yet (it may still write) is kept and retried, with whatever
must be freed after it (a landing room), so nothing is freed while NIXL may write into it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pdserve.disagg.layout import Descriptor
from pdserve.disagg.nixl.metadata import HANDOFF_PREFIX
from pdserve.disagg.nixl.ucx_env import apply_ucx_gpu_defaults
from pdserve.disagg.stats import TransferStats

log = logging.getLogger("pdserve.disagg.nixl")

NIXL_MISSING = "transfer backend 'nixl' needs the nixl package (pip install nixl==1.5.1)"


def nixl_reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def is_disconnect(e: Exception) -> bool:
    """NIXL's error for a remote agent that went away (the peer's process died)."""
    return type(e).__name__ == "nixlRemoteDisconnectError"


class NixlAgent:
    def __init__(self, name: str, *, progress_thread: bool, gpu_defaults: bool, stats: TransferStats) -> None:
        """name: the engine id (peers know the agent by it). progress_thread: NIXL's own UCX
        progress thread. gpu_defaults: set the UCX environment for a pool on the GPU first, since
        UCX reads its variables when NIXL loads it. No transport is narrowed: UCX needs tcp for
        its messages."""
        self.ucx_env_applied: dict[str, str] = apply_ucx_gpu_defaults() if gpu_defaults else {}
        if self.ucx_env_applied:
            log.info("UCX defaults for a GPU pool: %s", self.ucx_env_applied)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"{NIXL_MISSING}: {e}") from e
        self.nixl = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
        if "UCX" not in self.nixl.backends:
            raise RuntimeError("NIXL's UCX backend plugin is missing from this nixl install")
        self.stats = stats
        self.lock = threading.Lock()  # the progress thread and the engine loop share the agent
        self._releases: list[bytes] = []  # notifications that arrived and were not hand-offs
        self._handoffs: list[tuple[str, bytes]] = []  # hand-offs that arrived: (sender agent, payload)
        self._zombies: list[tuple[object, Callable[[], None] | None]] = []  # handles not released yet, what follows
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reg = None

    # -- memory and peers --
    def register(self, tensors: list) -> None:
        self._reg = self.nixl.register_memory(tensors)

    def metadata(self) -> bytes:
        return self.nixl.get_agent_metadata()

    def add_remote(self, agent_metadata: bytes) -> str:
        """Load a peer agent; its name as str (NIXL returns bytes, notifications are keyed by str)."""
        name = self.nixl.add_remote_agent(agent_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        self.nixl.remove_remote_agent(name)

    # -- notifications --
    def start_progress(self, interval_s: float) -> None:
        """Progress UCX and collect notifications from a thread, every interval_s."""
        self._thread = threading.Thread(
            target=self._progress_loop, args=(interval_s,), name="nixl-progress", daemon=True
        )
        self._thread.start()

    def _progress_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                with self.lock:
                    self._drain()
            except Exception as e:  # keep progressing: reads stall without it; poll_releases sees the error too
                self.stats.record_control_failure("progress")
                log.warning("NIXL progress: %s", nixl_reason(e))
                self._stop.wait(1.0)

    def _drain(self) -> None:
        """Progress UCX and sort what notifications arrived (the caller holds the lock)."""
        for agent, msgs in self.nixl.get_new_notifs().items():
            for msg in msgs:
                if msg.startswith(HANDOFF_PREFIX):
                    sender = agent.decode() if isinstance(agent, bytes) else agent
                    self._handoffs.append((sender, msg[len(HANDOFF_PREFIX) :]))
                else:
                    self._releases.append(msg)

    def take_releases(self) -> list[bytes]:
        with self.lock:
            self._drain()
            releases, self._releases = self._releases, []
        return releases

    def take_handoffs(self) -> list[tuple[str, bytes]]:
        with self.lock:
            self._drain()
            handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def notify(self, agent_name: str, msg: bytes) -> None:
        self.nixl.send_notif(agent_name, msg)

    # -- transfers --
    def prepare_read(
        self, local: list[Descriptor], local_mem: str, remote: list[Descriptor], remote_mem: str, agent_name: str
    ) -> object:
        """A READ of remote into local from agent_name, not yet posted: its transfer handle. No
        notification is attached: the release is sent once DONE is seen."""
        return self.nixl.initialize_xfer(
            "READ", self.nixl.get_xfer_descs(local, local_mem), self.nixl.get_xfer_descs(remote, remote_mem), agent_name
        )

    def post(self, xfer: object) -> str:
        """Start a prepared transfer: NIXL's first state ("DONE" when it completed at once)."""
        return self.nixl.transfer(xfer)

    def state(self, xfer: object) -> str:
        """ "DONE", "ERR" or still in progress; raises as NIXL does (a disconnected peer)."""
        return self.nixl.check_xfer_state(xfer)

    def release(self, xfer: object, then: Callable[[], None] | None = None) -> None:
        """Free a transfer handle (cancelling it if active), then call `then`; a handle NIXL will
        not free yet is kept with `then` and retried (retry_releases), never dropped."""
        if xfer is not None:
            try:
                xfer.release()
            except Exception:
                self._zombies.append((xfer, then))
                return
        if then is not None:
            then()

    def retry_releases(self) -> None:
        zombies, self._zombies = self._zombies, []
        for xfer, then in zombies:
            self.release(xfer, then)

    # -- shutdown --
    def stop_progress(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def deregister(self) -> None:
        if self._reg is not None:
            self.nixl.deregister_memory(self._reg)
            self._reg = None
