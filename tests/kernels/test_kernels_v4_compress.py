"""DeepSeek-V4's compressor decode step in one kernel (kernels/compress.py) against the module's own
torch path (`CompressedKV.update`, which the engine tests check against transformers): the same
entries and the same state records, for CSA (overlapping, rate 4) and HCA (rate 16) compressors,
positions at every place in a group (the first group, a group's first and last token), fp32 and
bf16 pools, unused state rows untouched; the CSA cases with the loader's joined kv / gate
projections (one GEMM: the kernel reads the two halves of its output).

The kernel rounds where PyTorch rounds and differs from it only in float32 (the softmax's exp and
sum, the pooled sum's order, the norm's rsqrt: a few float32 ulps), which can put a value across a
rounding boundary. An entry goes through 4 roundings a side (the softmax weight, each product, the
pooled sum, the norm; 5 on the roped dims) and through a sum that may cancel: `_entries_close`
bounds it from the pooled sum's terms, end to end and stage by stage (the pooled values the two
paths hand to kv_norm, captured). The state records are copies and one float32 sum (gate + bias),
each rounded once on each side from the same float32 value: equal bit for bit.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from pdserve.model import ops  # noqa: E402
from pdserve.model.deepseek_v4 import compressor  # noqa: E402
from pdserve.model.deepseek_v4.compressor import CompressedKV  # noqa: E402
from pdserve.model.deepseek_v4.layers import join_rows, joined_rows, normed_records  # noqa: E402
from pdserve.model.deepseek_v4.step import decode_group_plan  # noqa: E402
from pdserve_kernels.ref_glue import rms_norm_ref, rope_tail_ref  # noqa: E402
from tests.helpers.kernels import (  # noqa: E402
    DEVICE,
    U,
    close_within,
    mostly_equal,
    require_interpreter,
    rope_terms,
    seed_of,
)

pytestmark = pytest.mark.timeout(600)
require_interpreter()
HIDDEN, BS = 48, 16


class _Rope:
    def __call__(self, positions):
        p = positions.float()[:, None] * torch.arange(1, 5, device=positions.device) / 50
        return p.cos(), p.sin()  # R = 8


def _state_dim(dim, m, overlap):
    C = 2 * dim if overlap else dim
    return 2 * (m - 1) * C + (2 * m * dim if overlap else 0)


def _through_rope(err: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """An error of at most err after the rotation: err on the dims not roped, `rope_terms` on the tail."""
    R = 2 * cos.shape[-1]
    return torch.cat([err[..., :-R].double(), rope_terms(err, cos, sin)[..., -R:]], dim=-1)


def _through_norm(dp: torch.Tensor, p: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """How far w * p * r, r = rsqrt(mean p^2 + eps), moves when each p_i moves by at most dp_i, to
    first order: |w| r (dp + |p| sum_k |p_k| dp_k / (sum_k p_k^2 + D eps)), through p itself and
    through r (dr = -r^3 sum_k p_k dp_k / D)."""
    p, dp = p.double(), dp.double()
    ss = p.square().sum(-1, keepdim=True) + p.shape[-1] * eps
    r = torch.rsqrt(ss / p.shape[-1])
    return w.double().abs() * r * (dp + p.abs() * (p.abs() * dp).sum(-1, keepdim=True) / ss)


def _update(comp: CompressedKV, backend: str, monkeypatch, *args, **kwargs) -> torch.Tensor:
    """comp.update(*args, **kwargs) on one backend -> the pooled entries [U, Dc] it handed to kv_norm
    (the Triton path's `normed_records`, the torch path's kv_norm module), captured."""
    seen = []

    def keep(norm, pooled, *rest):
        seen.append(pooled.clone())
        return normed_records(norm, pooled, *rest)

    monkeypatch.setattr(compressor, "normed_records", keep)
    hook = comp.kv_norm.register_forward_pre_hook(lambda _, a: seen.append(a[0].clone()))
    try:
        ops.set_backend(backend)
        with torch.no_grad():
            comp.update(*args, **kwargs)
    finally:
        ops.set_backend(None)
        hook.remove()
    assert seen, "update normed no entries"
    return seen[0]


def _abs_kv(states: torch.Tensor, dim: int, m: int, overlap: bool) -> torch.Tensor:
    """states with the kv values of each record (the pending rows, the Ca) made absolute."""
    n = (m - 1) * (2 * dim if overlap else dim)
    out = states.clone()
    out[:, :n] = out[:, :n].abs()
    if overlap:
        out[:, 2 * n : 2 * n + m * dim] = out[:, 2 * n : 2 * n + m * dim].abs()
    return out


def _pooled_terms(comp, monkeypatch, x, ix, slots, entries, states, dst=None) -> torch.Tensor:
    """[U, Dc] sum_j w_j |kv_j|, the scale of the pooled sum's terms: the module's torch path pooling
    |kv| (the softmax weights w_j are positive), the same gates (rounded as pooled is: second order in U)."""
    kv, gate = comp.project(x)
    states = _abs_kv(states, comp.dim, comp.rate, comp.overlap)
    return _update(comp, "torch", monkeypatch, x, ix, slots, entries.clone(), states, dst=dst, proj=(kv.abs(), gate))


def _entries_close(got, want, got_pooled, want_pooled, terms, comp, rope, dtype) -> None:
    """The entries of the groups (got, want [U, Dc], the pooled values each path normed, terms:
    `_pooled_terms`), end to end and stage by stage."""
    cos, sin = (t.cpu() for t in rope)
    w, eps, u = comp.kv_norm.weight.cpu(), comp.kv_norm.eps, U[dtype]
    got_pooled, want_pooled, terms = got_pooled.cpu(), want_pooled.cpu(), terms.cpu().double()
    # pooled = sum_j kv_j w_j: each w_j rounded, each product rounded (2 U a side of |w_j kv_j|, summed:
    # 4 U terms, whatever the sum cancels), the sum rounded (U a side: 2 U |pooled|)
    close_within(got_pooled, want_pooled, dtype, "pooled", 2, 4 * u * terms)
    mostly_equal(got_pooled, want_pooled)
    # kv_norm then rope of the kernel's own pooled values: one rounding a side each (the norm, the
    # rope), the normed values' through the rotation (as the glue test's weighted+rope)
    normed = rms_norm_ref(got_pooled, w, eps)
    close_within(
        got, rope_tail_ref(normed, cos, sin), dtype, "kv_norm and rope", 2, 2 * u * rope_terms(normed, cos, sin)
    )
    mostly_equal(got, rope_tail_ref(normed, cos, sin), 2)
    # end to end: the pooled bound (2 U |pooled| + 4 U terms) through the norm (its own division by
    # rms included), the norm's rounding (2 U |normed|) through the rope, the last rounding (2 U |want|)
    # on each dim: 4 roundings a side, 5 on the roped dims
    normed = rms_norm_ref(want_pooled, w, eps)
    moved = _through_norm(2 * u * want_pooled.double().abs() + 4 * u * terms, want_pooled, w, eps)
    inner = _through_rope(moved, cos, sin) + 2 * u * rope_terms(normed, cos, sin)
    close_within(got, want, dtype, "entries", 2, inner)


@pytest.mark.parametrize("overlap,dim,m", [(True, 40, 4), (False, 24, 16), (True, 16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_decode_is_the_modules_update(overlap, dim, m, dtype, monkeypatch):
    g = torch.Generator().manual_seed(seed_of("compress", overlap, dim, m, dtype))
    comp = CompressedKV(HIDDEN, dim, m, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    comp.position_bias.data = comp.position_bias.data.float()
    comp = comp.to(DEVICE, dtype)
    comp.position_bias.data, comp.kv_norm.weight.data = (
        comp.position_bias.data.float(),
        comp.kv_norm.weight.data.float(),
    )
    if overlap:  # the loader's joined projections: one GEMM, the kernel reads its halves' strided rows
        join_rows(comp.kv_proj, comp.gate_proj)
        assert joined_rows(comp.kv_proj.weight, comp.gate_proj.weight) is not None
    # positions: the first group (no previous Ca), a group's first / middle / last token, later groups
    starts = torch.tensor([0, 1, m - 1, m, m + 1, 2 * m - 1, 5 * m + 2, 7 * m - 1, 3])
    B, S, width = starts.shape[0], 20, 16
    x = torch.randn(B, HIDDEN, generator=g).to(DEVICE, dtype)
    states = torch.randn(S, _state_dim(dim, m, overlap), generator=g).to(DEVICE, dtype)
    slots = torch.randperm(S, generator=g)[:B].to(DEVICE)
    table = (torch.arange(B * width).view(B, width) + 3).to(DEVICE, torch.int32)
    batch = SimpleNamespace(starts=starts.to(DEVICE), decode_rows=torch.arange(B, device=DEVICE))
    page = BS // m if m <= BS else 1
    plan = decode_group_plan(batch, m, table, page, _Rope())
    ix = SimpleNamespace(groups=plan)
    entries = torch.full((B * width * page + 64, dim), float("nan"), device=DEVICE, dtype=dtype)
    got_states, got_entries = states.clone(), entries.clone()
    terms = _pooled_terms(comp, monkeypatch, x, ix, slots, entries, states)
    want_pooled = _update(comp, "torch", monkeypatch, x, ix, slots, entries, states)
    got_pooled = _update(comp, "triton", monkeypatch, x, ix, slots, got_entries, got_states)
    rows = plan.slot.long()
    assert got_entries[rows].isfinite().all()
    _entries_close(got_entries[rows], entries[rows], got_pooled, want_pooled, terms, comp, plan.rope, dtype)
    # the records: copies of the rows and gate + bias (float32), each rounded once to the state's
    # dtype from the same float32 value on both sides, no float32 difference before it (-inf gates too)
    assert torch.equal(got_states, states), "the state records, bit for bit"
    if dtype != torch.float32:
        assert (got_entries[rows] != entries[rows]).float().mean() <= 0.02


def test_compress_decode_refuses_a_state_of_another_size():
    kv = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="compress_decode"):
        ops.compress_decode(kv, kv, torch.zeros(4, 10, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                            torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(4, 8, device=DEVICE), 8, False)  # fmt: skip
