"""The two ceilings the floor is measured against, taken in the same run on the same device: the
copy rate (one large device-to-device copy, bytes read + bytes written over its time) and the
matmul rate (one large square GEMM in the model's dtype, 2 n^3 flops over its time). Median of
`reps` timed runs after one warm-up, on random data (never zeros)."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs (synchronized: the host clock sees the device's work)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy of nbytes (read + write counted)."""
    src = torch.randint(-(2**15), 2**15, (nbytes // 2,), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src), device, reps)


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, reps: int = 10) -> float:
    """Flops per second of an n x n x n GEMM in dtype."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, reps)


def measure(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Both ceilings at sizes that fill the device (GPU: 2 GiB copied, n = 8192; CPU: small)."""
    big = device.type == "cuda"
    return {
        "copy_bytes_per_s": copy_rate(device, 2 * 2**30 if big else 64 * 2**20),
        "matmul_flops_per_s": matmul_rate(device, 8192 if big else 512, dtype),
    }
