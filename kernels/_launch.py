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
