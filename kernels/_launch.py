"""Device facts the kernel wrappers size their launches from (cached per device)."""

from __future__ import annotations

import functools

import torch
import triton


@functools.cache
def _props(index: int) -> tuple[int, int]:
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.major * 10 + p.minor


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small fixed number for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return _props(device.index if device.index is not None else torch.cuda.current_device())[0]


def capability(device: torch.device) -> int:
    """Compute capability as an int (90 for H100/H200, 120 for RTX PRO 6000); 0 on CPU."""
    if device.type != "cuda":
        return 0
    return _props(device.index if device.index is not None else torch.cuda.current_device())[1]


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for host code: `triton.cdiv` is a constexpr function whose Python call
    costs ~20 us (argument unwrapping), several times per launch at decode shapes."""
    return -(-a // b)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1. The interpreter (with numpy >= 2.4) cannot use a runtime
    argument as a loop bound, so kernels take the bound as a constexpr too and use it only there
    (`range(0, N_CONST if INTERPRET else n)`): compiled kernels do not specialize on it."""
    return bool(triton.knobs.runtime.interpret)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept alive for graphs captured with them


def arrival_counters(device: torch.device, n: int, who: str) -> torch.Tensor:
    """int32 arrival counters for kernels whose last program to arrive finishes a reduction
    (sparse MLA's fused merge, the FP8 GEMV's split-K sum): zero between launches (that program
    resets its own), so one buffer per device serves every kernel, call and CUDA-graph replay.
    Calls on one device must not overlap on two streams. Grows only outside graph capture (a
    graph cannot zero a buffer made while capturing before it replays)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{who} needs {n} arrival counters on {device} but has {0 if buf is None else buf.numel()}: "
            "call it once at this batch size before capturing a CUDA graph"
        )
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[device] = buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf
