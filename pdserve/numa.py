"""NUMA placement: read the machine's nodes and GPU locality from sysfs/NVML, and pin a process.

A worker is pinned to one NUMA node so its CPU threads and host memory (the KV pool on CPU, the
pinned staging buffers on GPU) sit next to its GPUs. Pinning is `numactl --cpunodebind=N
--membind=N` where numactl is installed (it binds memory too), else `os.sched_setaffinity` in the
child before exec (CPUs only). Every decision carries a reason so the launcher can print it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

SYS_NODE_DIR = "/sys/devices/system/node"
SYS_PCI_DIR = "/sys/bus/pci/devices"
NVIDIA_PCI_VENDOR = "0x10de"
GPU_PCI_CLASSES = ("0x0300", "0x0302")  # VGA controller, 3D controller (the datacenter parts)


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8-11' -> [0, 1, 2, 3, 8, 9, 10, 11] (the kernel's cpulist format; '' -> [])."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad cpulist {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad cpulist {text!r}: range {part!r} is empty or negative")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (inverse of parse_cpulist)."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def numa_nodes(node_dir: str = SYS_NODE_DIR) -> dict[int, list[int]]:
    """NUMA node id -> its CPUs, from sysfs. {} where the kernel exposes no NUMA information."""
    if not os.path.isdir(node_dir):
        return {}
    nodes: dict[int, list[int]] = {}
    for name in os.listdir(node_dir):
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(node_dir, name, "cpulist")) as f:
                nodes[int(name[4:])] = parse_cpulist(f.read())
    return dict(sorted(nodes.items()))


def process_cpus(pid: int) -> list[int]:
    """The CPUs a running process may use, as the kernel reports them (Cpus_allowed_list)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
    raise RuntimeError(f"/proc/{pid}/status has no Cpus_allowed_list")


def pci_numa_node(bus_id: str, pci_dir: str = SYS_PCI_DIR) -> int | None:
    """NUMA node of a PCI device ('00000000:17:00.0' NVML style or '0000:17:00.0'); None if unknown."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    path = os.path.join(pci_dir, f"{int(domain, 16):04x}:{rest}", "numa_node")
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform does not say


def _nvml_bus_ids() -> list[str] | None:
    """PCI bus ids of the GPUs in NVML's index order, or None if NVML is absent or fails."""
    try:
        import pynvml  # from nvidia-ml-py; optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError subclasses (no driver, no GPU): treat as "no NVML"
        return None
    try:
        ids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
            ids.append(bus.decode() if isinstance(bus, bytes) else bus)
        return ids
    finally:
        pynvml.nvmlShutdown()


def _sysfs_gpu_bus_ids(pci_dir: str = SYS_PCI_DIR) -> list[str]:
    """NVIDIA GPUs on the PCI bus, in bus order (the order CUDA_DEVICE_ORDER=PCI_BUS_ID gives)."""
    if not os.path.isdir(pci_dir):
        return []
    found = []
    for dev in sorted(os.listdir(pci_dir)):
        try:
            with open(os.path.join(pci_dir, dev, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(pci_dir, dev, "class")) as f:
                cls = f.read().strip()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and cls[:6] in GPU_PCI_CLASSES:
            found.append(dev)
    return found


def gpu_numa_node(gpu: int, pci_dir: str = SYS_PCI_DIR, nvml: bool = True) -> tuple[int | None, bool, str]:
    """(node or None, whether the GPU was found, why) for GPU index `gpu`: its PCI bus id from NVML
    if NVML works, else the NVIDIA GPUs in sysfs in bus order; then that device's sysfs numa_node."""
    bus_ids, source = (_nvml_bus_ids() if nvml else None), "NVML"
    if bus_ids is None:
        bus_ids, source = _sysfs_gpu_bus_ids(pci_dir), "sysfs (PCI bus order)"
    if gpu >= len(bus_ids):
        return None, False, f"GPU {gpu} not found via {source} ({len(bus_ids)} GPUs seen)"
    node = pci_numa_node(bus_ids[gpu], pci_dir)
    if node is None:
        return None, True, f"GPU {gpu} ({bus_ids[gpu]}, via {source}) reports no NUMA node"
    return node, True, f"GPU {gpu} ({bus_ids[gpu]}) is on node {node} via {source}"


def _auto_node(gpus: list[int], nodes: dict[int, list[int]], pci_dir: str, nvml: bool) -> tuple[int | None, str]:
    """numa_node 'auto': the node of the worker's first GPU (its GPUs should share one)."""
    if not gpus:
        return None, "numa_node auto needs gpus"
    node, found, why = gpu_numa_node(gpus[0], pci_dir, nvml)
    if node is None and found and len(nodes) == 1:  # VMs often report -1; one node leaves no choice
        (only,) = nodes
        return only, f"{why}; the machine has one NUMA node ({only})"
    if node is not None and node not in nodes:
        return None, f"{why}, but that node has no CPUs listed"
    return node, why


@dataclass(frozen=True)
class PinPlan:
    """How one process is placed. method 'none' runs it unpinned; `reason` says why."""

    method: Literal["numactl", "sched_setaffinity", "none"]
    node: int | None
    cpus: tuple[int, ...]  # the CPUs the process will be allowed; () when unpinned
    reason: str
    explicit_cpus: bool = False  # cpus narrowed by the config (numactl --physcpubind)

    def command_prefix(self) -> list[str]:
        """argv prefix that applies the plan (numactl), [] otherwise."""
        if self.method != "numactl":
            return []
        cpus = f"--physcpubind={format_cpulist(self.cpus)}" if self.explicit_cpus else f"--cpunodebind={self.node}"
        return ["numactl", cpus, f"--membind={self.node}"]

    def preexec(self) -> Callable[[], None] | None:
        """A function the child runs before exec (sched_setaffinity), None if nothing to do."""
        if self.method != "sched_setaffinity":
            return None
        cpus = set(self.cpus)
        return lambda: os.sched_setaffinity(0, cpus)


def plan_pinning(
    numa_node: int | Literal["auto"] | None,
    gpus: list[int],
    cpus: str | None = None,
    node_dir: str = SYS_NODE_DIR,
    use_numactl: bool | None = None,
    pci_dir: str = SYS_PCI_DIR,
    nvml: bool = True,
) -> PinPlan:
    """Resolve a worker's placement. numa_node 'auto': the node of its first GPU; None: unpinned.
    `cpus` narrows the node to a cpulist within it. An 'auto' node that cannot be resolved is logged
    and the worker runs unpinned; a node number that does not exist is an error."""
    if numa_node is None:
        return PinPlan("none", None, (), "no numa_node configured")
    nodes = numa_nodes(node_dir)
    if numa_node == "auto":
        numa_node, why = _auto_node(gpus, nodes, pci_dir, nvml)
        if numa_node is None:
            log.warning("not pinning: %s", why)
            return PinPlan("none", None, (), why)
        log.info("numa_node auto: %s", why)
    if not nodes:
        why = f"{node_dir} lists no NUMA nodes"
        log.warning("not pinning to node %d: %s", numa_node, why)
        return PinPlan("none", None, (), why)
    if numa_node not in nodes:
        raise ValueError(f"NUMA node {numa_node} does not exist on this machine (nodes: {sorted(nodes)})")
    chosen = nodes[numa_node]
    if cpus is not None:
        wanted = parse_cpulist(cpus)
        outside = sorted(set(wanted) - set(chosen))
        if not wanted or outside:
            raise ValueError(
                f"cpus {cpus!r} must be a non-empty subset of node {numa_node}'s CPUs "
                f"{format_cpulist(chosen)} (outside: {format_cpulist(outside)})"
            )
        chosen = wanted
    if use_numactl is None:
        use_numactl = shutil.which("numactl") is not None
    method = "numactl" if use_numactl else "sched_setaffinity"
    return PinPlan(method, numa_node, tuple(chosen), f"node {numa_node}", explicit_cpus=cpus is not None)
