"""Shared helpers of the kernel tests (tests/kernels/test_kernels_*.py): device, dtypes, tolerances."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from benchmarks.kernels.bench_util import poisoned_empty  # noqa: F401  (re-exported for the tests)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's bf16 tl.dot is wrong (triton issue 11584): bf16 is checked on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# relative L2 error allowed per input dtype (fp32 dots run in IEEE mode)
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    err = rel_err(out, want)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e} ({dtype})"


def require_interpreter() -> None:
    """On CPU the kernels can only run interpreted; fail clearly if triton was imported before
    TRITON_INTERPRET=1 could be set (see the docstring of test_kernels_sparse_mla.py)."""
    if DEVICE == "cuda":
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set; run the "
            "kernel tests with TRITON_INTERPRET=1 in the environment"
        )


def seed_of(*parts: object) -> int:
    """A seed from a test's parameters, the same in every process (Python's hash() of a string is not)."""
    return zlib.crc32(repr(parts).encode())


def assert_fields_equal(got, want, name: str) -> None:
    """got == want through dicts, dataclasses and (cos, sin) pairs: tensors of the same dtype and
    shape, equal bit for bit, except the pairs' floats (within 2e-6: numpy's cos against torch's)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), name
        for k in want:
            assert_fields_equal(got[k], want[k], f"{name}.{k}")
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_fields_equal(getattr(got, f.name), getattr(want, f.name), f"{name}.{f.name}")
    elif isinstance(want, tuple):  # (cos, sin)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name}[{i}]"
            torch.testing.assert_close(a.cpu().double(), b.cpu().double(), rtol=0, atol=2e-6, msg=f"{name}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype} {got.shape}"
        assert torch.equal(got.cpu(), want.cpu()), name
    else:
        assert got == want, name
