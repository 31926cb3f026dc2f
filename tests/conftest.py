"""Tests by kind: unit/ (one process), kernels/ (Triton kernels against torch references; the
interpreter on CPU), e2e/ (real processes on free loopback ports), helpers/ (what tests share).
Every test that starts a process is marked `slow`, which this file enforces, so that
`pytest -m "not slow"` is the quick run."""

import multiprocessing.process
import os
import shlex
import subprocess
import sys

# Make the source tree importable without an install (CI installs it editable anyway):
# `pdserve` from the repo root and `pdserve_kernels` from kernels/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without CUDA the Triton kernels run only interpreted, and TRITON_INTERPRET must be set before
# anything imports triton (the model reaches the kernels too), whichever test file comes first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker a core, at most 4 (each holds torch, and the end-to-end tests start
    servers of their own; more workers only make them wait on each other)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="module")
def restore_torch_threads():
    """An engine with cpu_threads sets torch's threads process-wide: leave the rest of the suite as found."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def poisoned():
    """Every torch.empty of the test is poisoned (benchmarks/kernels/bench_util.poisoned_empty):
    an output element a kernel leaves unwritten fails the comparison."""
    from benchmarks.kernels.bench_util import poisoned_empty

    with poisoned_empty():
        yield


# The test now being set up, run or torn down (module fixtures start their processes during the
# setup of their first test, so this is checked there too).
_current: list[pytest.Item | None] = [None]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item
    try:
        return (yield)
    finally:
        _current[0] = None


_WRAPPERS = {"numactl", "taskset", "env", "setsid", "nice", "timeout"}


def _starts_python(args) -> bool:
    """Whether the command runs Python or pdserve (itself, or behind a wrapper such as numactl);
    a tool that merely names the interpreter (`file -b python3`, as platform.architecture runs) is not."""
    if isinstance(args, (bytes, os.PathLike)):
        args = [args]  # one program path, no arguments
    argv = shlex.split(args) if isinstance(args, str) else [os.fsdecode(a) for a in args]
    for arg in argv:
        name = os.path.basename(arg)
        if name.startswith("python") or name == "pdserve" or arg == sys.executable:
            return True
        if name not in _WRAPPERS and not arg.startswith("-") and not arg.isdigit() and "=" not in arg:
            return False  # the program that runs is something else
    return False


def _refuse_unless_slow(what: str) -> None:
    item = _current[0]
    if item is not None and item.get_closest_marker("slow") is None:
        raise RuntimeError(f"{item.nodeid} starts a process ({what}) but is not marked slow")


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _checked_popen_init(self, args, *a, **kw):
    if _starts_python(args):
        _refuse_unless_slow(f"Popen {args!r:.120}")
    _popen_init(self, args, *a, **kw)


def _checked_process_start(self):
    _refuse_unless_slow(f"multiprocessing {self.name}")
    _process_start(self)


subprocess.Popen.__init__ = _checked_popen_init
multiprocessing.process.BaseProcess.start = _checked_process_start


def pytest_collection_modifyitems(config, items):
    """Everything under e2e/ starts real processes: slow by where it lives."""
    e2e = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e") + os.sep
    for item in items:
        if str(item.path).startswith(e2e):
            item.add_marker(pytest.mark.slow)
