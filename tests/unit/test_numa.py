"""NUMA helpers: cpulists, node discovery (fake and real sysfs), GPU locality, pinning real children."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from pdserve.numa import (
    PinPlan,
    _sysfs_gpu_bus_ids,
    format_cpulist,
    gpu_numa_node,
    numa_nodes,
    parse_cpulist,
    pci_numa_node,
    plan_pinning,
    process_cpus,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "text, cpus",
    [("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]), ("0", [0]), ("", []), ("5,1-2\n", [1, 2, 5]), ("3,3,2-3", [2, 3])],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "1-", "-2", "0-3,x"])
def test_parse_cpulist_rejects_garbage(bad):
    with pytest.raises(ValueError, match="bad cpulist"):
        parse_cpulist(bad)


def test_format_cpulist_round_trips():
    assert format_cpulist([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3,8-11"
    assert format_cpulist({5, 1, 2}) == "1-2,5"
    assert format_cpulist([]) == ""
    for text in ["0-3,8-11", "7", "0,2,4-6"]:
        assert format_cpulist(parse_cpulist(text)) == text


def _fake_nodes(root, nodes):
    for node, cpulist in nodes.items():
        os.makedirs(root / f"node{node}")
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (root / "online").write_text("0-1\n")  # sysfs also has files that are not nodes
    os.makedirs(root / "power")


def test_numa_nodes_fake_sysfs(tmp_path):
    _fake_nodes(tmp_path, {1: "4-7", 0: "0-3"})
    assert numa_nodes(str(tmp_path)) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert numa_nodes(str(tmp_path / "missing")) == {}


def test_numa_nodes_real_sysfs():
    nodes = numa_nodes()
    assert 0 in nodes and nodes[0], nodes
    covered = {c for cpus in nodes.values() for c in cpus}
    assert os.sched_getaffinity(0) <= covered  # every CPU we may run on belongs to a node


def test_process_cpus_reads_proc():
    assert set(process_cpus(os.getpid())) == os.sched_getaffinity(0)


def _fake_pci(root, dev, vendor, cls, node):
    d = root / dev
    os.makedirs(d)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(cls + "\n")
    (d / "numa_node").write_text(f"{node}\n")


def test_pci_numa_node_and_gpu_discovery(tmp_path):
    _fake_pci(tmp_path, "0000:c1:00.0", "0x10de", "0x030200", 1)  # GPU, node 1
    _fake_pci(tmp_path, "0000:17:00.0", "0x10de", "0x030000", 0)  # GPU, node 0
    _fake_pci(tmp_path, "0000:18:00.0", "0x10de", "0x040300", 0)  # NVIDIA audio: not a GPU
    _fake_pci(tmp_path, "0000:19:00.0", "0x8086", "0x030000", 0)  # another vendor
    _fake_pci(tmp_path, "0000:1a:00.0", "0x10de", "0x030200", -1)  # GPU, platform gives no node
    assert _sysfs_gpu_bus_ids(str(tmp_path)) == ["0000:17:00.0", "0000:1a:00.0", "0000:c1:00.0"]
    assert pci_numa_node("00000000:C1:00.0", str(tmp_path)) == 1  # NVML's 8-digit domain, upper case
    assert pci_numa_node("0000:17:00.0", str(tmp_path)) == 0
    assert pci_numa_node("0000:1a:00.0", str(tmp_path)) is None
    assert pci_numa_node("0000:99:00.0", str(tmp_path)) is None


def test_gpu_numa_node_unknown_gpu_says_why():
    node, found, why = gpu_numa_node(10_000)
    assert node is None and not found and "GPU 10000 not found" in why


def test_auto_node_from_sysfs_gpus(tmp_path):
    pci, two, one = tmp_path / "pci", tmp_path / "two", tmp_path / "one"
    _fake_pci(pci, "0000:17:00.0", "0x10de", "0x030200", 0)
    _fake_pci(pci, "0000:c1:00.0", "0x10de", "0x030200", 1)
    _fake_pci(pci, "0000:c2:00.0", "0x10de", "0x030200", -1)
    _fake_nodes(two, {0: "0-3", 1: "4-7"})
    _fake_nodes(one, {0: "0-7"})
    kw = {"pci_dir": str(pci), "nvml": False, "use_numactl": True}
    assert gpu_numa_node(1, str(pci), nvml=False) == (
        1,
        True,
        "GPU 1 (0000:c1:00.0) is on node 1 via sysfs (PCI bus order)",
    )
    first = plan_pinning("auto", [1, 0], node_dir=str(two), **kw)  # the first GPU decides
    assert (first.node, first.cpus, first.command_prefix()) == (
        1,
        (4, 5, 6, 7),
        ["numactl", "--cpunodebind=1", "--membind=1"],
    )
    assert plan_pinning("auto", [0], node_dir=str(two), **kw).node == 0
    silent = plan_pinning("auto", [2], node_dir=str(two), **kw)  # reports -1 on a two-node machine
    assert silent.method == "none" and "reports no NUMA node" in silent.reason
    assert plan_pinning("auto", [2], node_dir=str(one), **kw).node == 0  # one node: no choice to make
    assert plan_pinning("auto", [3], node_dir=str(one), **kw).method == "none"  # no such GPU


def test_plan_pinning_decisions(tmp_path):
    _fake_nodes(tmp_path, {0: "0-3", 1: "4-7"})
    d = str(tmp_path)
    assert plan_pinning(None, [], node_dir=d).method == "none"
    assert "needs gpus" in plan_pinning("auto", [], node_dir=d).reason
    unknown = plan_pinning("auto", [10_000], node_dir=d, nvml=False)
    assert unknown.method == "none" and "not found" in unknown.reason
    numactl = plan_pinning(1, [], node_dir=d, use_numactl=True)
    assert numactl.command_prefix() == ["numactl", "--cpunodebind=1", "--membind=1"]
    assert numactl.cpus == (4, 5, 6, 7) and numactl.preexec() is None
    narrowed = plan_pinning(1, [], cpus="6-7", node_dir=d, use_numactl=True)
    assert narrowed.command_prefix() == ["numactl", "--physcpubind=6-7", "--membind=1"]
    affinity = plan_pinning(0, [], node_dir=d, use_numactl=False)
    assert affinity.method == "sched_setaffinity" and affinity.cpus == (0, 1, 2, 3)
    assert affinity.command_prefix() == [] and affinity.preexec() is not None
    with pytest.raises(ValueError, match=r"NUMA node 5 does not exist on this machine \(nodes: \[0, 1\]\)"):
        plan_pinning(5, [], node_dir=d)
    with pytest.raises(ValueError, match="subset of node 0's CPUs 0-3 \\(outside: 4\\)"):
        plan_pinning(0, [], cpus="3-4", node_dir=d)
    assert plan_pinning(0, [], node_dir=str(tmp_path / "none")).method == "none"


def _our_node0_cpus() -> list[int]:
    return sorted(set(numa_nodes()[0]) & os.sched_getaffinity(0))


def _run_pinned(plan: PinPlan) -> subprocess.Popen:
    argv = plan.command_prefix() + [sys.executable, "-c", "import time; time.sleep(30)"]
    return subprocess.Popen(argv, preexec_fn=plan.preexec())


def _after_exec(proc: subprocess.Popen) -> list[int]:
    """numactl binds, then execs the command: wait for the exec, then read the child's CPUs."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            cmdline = f.read()  # forked pytest, then numactl ..., then python -c ...sleep...
        if cmdline.startswith(sys.executable.encode()) and b"time.sleep(30)" in cmdline:
            return process_cpus(proc.pid)
        time.sleep(0.02)
    raise AssertionError(f"numactl (pid {proc.pid}) did not exec its command within 10 s")


@pytest.mark.slow
def test_sched_setaffinity_pins_a_real_child():
    last = _our_node0_cpus()[-1]
    plan = plan_pinning(0, [], cpus=str(last), use_numactl=False)
    proc = _run_pinned(plan)
    try:
        assert process_cpus(proc.pid) == [last]  # set in the child before exec
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("numactl") is None,
    reason="numactl is not installed (apt-get install -y numactl; .ci/run does): launch pins with sched_setaffinity instead, which the other tests check",
)
def test_numactl_pins_a_real_child():
    cpus = _our_node0_cpus()
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    # --cpunodebind widens a child started on one CPU to the node: numactl itself set it.
    node_plan = plan_pinning(0, [], use_numactl=True)
    proc = subprocess.Popen(node_plan.command_prefix() + argv, preexec_fn=lambda: os.sched_setaffinity(0, {cpus[-1]}))
    try:
        assert _after_exec(proc) == cpus
        with open(f"/proc/{proc.pid}/numa_maps") as f:
            assert "bind:0" in f.read()  # --membind=0 took effect
    finally:
        proc.kill()
        proc.wait()
    # --physcpubind narrows (numactl accepts only CPUs its caller may use, so start unrestricted).
    narrow_plan = plan_pinning(0, [], cpus=str(cpus[0]), use_numactl=True)
    proc = subprocess.Popen(narrow_plan.command_prefix() + argv)
    try:
        assert _after_exec(proc) == [cpus[0]]
    finally:
        proc.kill()
        proc.wait()
