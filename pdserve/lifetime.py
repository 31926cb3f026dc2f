"""A child process's lifetime tied to its parent's: the launcher's workers and router, the
router's processes (--api-server-count) and tensor-parallel ranks all end when what started them
does, so none keeps a port, a GPU or a rendezvous from its restarted successor. And whether a
process is still there (what a dead one left behind is then for others to remove)."""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int, libc: ctypes.CDLL | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux), and exit now if
    the parent is already gone (it can die before prctl takes effect). libc: loaded before a fork,
    for use in a preexec_fn."""
    if sys.platform.startswith("linux"):
        (libc or ctypes.CDLL(None, use_errno=True)).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os._exit(1)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
