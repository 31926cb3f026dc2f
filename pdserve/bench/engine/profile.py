"""Where a decode step's time goes, by kernel class: torch.profiler over a few steps, each kernel
(on a GPU: the CUDA kernels and copies; on the CPU: the aten ops' self time) put in a class by
its name, and launch gaps = the step's measured wall time - the kernel time of one step (the time
the device waits for the host: Python, launches, host-built metadata, syncs).

Names are classified in this order (first match wins): attention (pdserve's sparse MLA and
indexer kernels, FlashAttention / SDPA), MoE (fused_moe), GEMM (cuBLAS / CUTLASS / nvjet and the
aten matmul ops), copy (memcpy / memset), norms / rope / other (everything else: elementwise,
reductions, softmax, top-k, gathers). Attention run by the torch reference kernels (on the CPU,
and in the naive baseline) is aten ops (einsum + softmax), so its time shows up as GEMM and other.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

CLASSES = (
    ("attention", re.compile(r"sparse_mla|_mla_|_index_scores|indexer|flash|fmha|sdpa|scaled_dot_product", re.I)),
    ("moe", re.compile(r"moe|_align_kernel|_w13_|_w2_|_swiglu_kernel", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|matmul|aten::(mm|addmm|bmm|linear|einsum|baddbmm)$", re.I)),
    ("copy", re.compile(r"memcpy|memset|aten::(copy_|to|_to_copy|index_put_|index_copy_)$", re.I)),
)
OTHER, GAPS = "norms/rope/other", "launch gaps"
ORDER = [c for c, _ in CLASSES] + [OTHER, GAPS]


def classify(name: str) -> str:
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return OTHER


def kernel_times(prof, device: torch.device) -> Counter:
    """Kernel name -> microseconds over the profiled region."""
    times: Counter = Counter()
    for e in prof.events():
        if device.type == "cuda" and e.device_type == DeviceType.CUDA:
            times[e.name] += e.time_range.elapsed_us()
        elif device.type == "cpu" and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            times[e.name] += e.self_cpu_time_total
    return times


def breakdown(step, device: torch.device, steps: int, step_ms: float) -> dict:
    """Profile `steps` calls of step(); ms per step by class (launch gaps against step_ms, the
    unprofiled median), each class's share of step_ms, and the top kernels."""
    # GPU: kernels only (recording every host op of a step too multiplies the events to process)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = kernel_times(prof, device)
    ms = Counter()
    for name, us in times.items():
        ms[classify(name)] += us / 1e3 / steps
    ms[GAPS] = step_ms - sum(ms.values())
    top = [{"name": n[:120], "class": classify(n), "ms_per_step": us / 1e3 / steps} for n, us in times.most_common(12)]
    return {
        "ms": {c: ms.get(c, 0.0) for c in ORDER},
        "share": {c: ms.get(c, 0.0) / step_ms for c in ORDER},
        "kernel_ms": sum(times.values()) / 1e3 / steps,
        "top_kernels": top,
    }
