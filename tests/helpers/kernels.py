"""Shared helpers of the kernel tests (tests/kernels/test_kernels_*.py): device, dtypes, tolerances
(relative L2 ones, and elementwise bounds from the roundings counted on each side: `close_within`)."""

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


# A rounding to nearest moves a value by at most U of it (half an ulp: bf16 keeps 8 significant bits,
# fp16 11, float32 24). The two sides round at the same places, from float32 values a few float32
# ulps apart, so an output is within k U of the reference, k its roundings counted on both sides
# (each weighted by what follows it: a sqrt halves a relative error, a division adds those of its
# operands), to first order in U; one rounding a side (k = 2) is the one ulp of a flipped rounding.
U = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}
F32 = 1e-5  # float32 outputs: relative, float32 sums in another order (~100 ulps)


def close_within(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    name: str,
    roundings: int = 2,
    inner: torch.Tensor | None = None,
    atol: float = 1e-5,
) -> None:
    """|got - want| <= roundings U |want| + inner + atol elementwise (float32: F32 |want|). inner
    (like want): what earlier roundings or float32 differences add through a sum that may cancel
    (it bounds an absolute error, not one relative to want)."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert not got.isnan().any(), f"{name}: an element was not written"
    got, want = got.cpu().double(), want.cpu().double()
    bound = (F32 if dtype == torch.float32 else roundings * U[dtype]) * want.abs() + atol
    bound = bound if inner is None else bound + inner.cpu()
    err = (got - want).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = int((err - bound).flatten().argmax())
        g, w, b = (t.flatten()[i].item() for t in (got, want, bound))
        raise AssertionError(f"{name}: {int(bad.sum())} outside the bound, worst {g} vs {w} (bound {b:.3g})")


def mostly_equal(got: torch.Tensor, want: torch.Tensor, reach: int = 1) -> None:
    """Rounded where PyTorch rounds: equal bits but where exp / rsqrt / a sum order differ in
    float32 just across a rounding boundary (each such element within `_close`'s bound). A rounding
    flips with odds of about (the float32 difference) / (one ulp), ~2^-15 (bf16) or 2^-12 (fp16) a
    float32 ulp: at most 1% of the elements differ, and a small tensor may hold one flip (reach: the
    outputs one flipped rounding changes, 2 where rope pairs them)."""
    if got.dtype != torch.float32:
        differ = int((got != want).sum())
        assert differ <= max(0.01 * got.numel(), reach), f"{differ} of {got.numel()} elements differ"


def rope_terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|x_i| |cos| + |x_partner| |sin| on the roped tail of x (0 elsewhere): the scale at which a
    rounding of x enters the rotation x0 cos - x1 sin, whatever that difference cancels."""
    R = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (R,)
    c = cos.double().abs().repeat_interleave(2, dim=-1).view(shape)
    s = sin.double().abs().repeat_interleave(2, dim=-1).view(shape)
    tail = x[..., -R:].double().abs()
    partner = tail.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.cat([torch.zeros_like(x[..., :-R], dtype=torch.float64), tail * c + partner * s], dim=-1)
