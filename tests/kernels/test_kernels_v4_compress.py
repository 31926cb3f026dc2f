"""DeepSeek-V4's compressor decode step in one kernel (kernels/compress.py) against the module's own
torch path (`CompressedKV.update`, which the engine tests check against transformers): the same
entries and the same state records, for CSA (overlapping, rate 4) and HCA (rate 16) compressors,
positions at every place in a group (the first group, a group's first and last token), fp32 and
bf16 pools, unused state rows untouched; the CSA cases with the loader's joined kv / gate
projections (one GEMM: the kernel reads the two halves of its output).

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
from pdserve.model.deepseek_v4.compressor import CompressedKV  # noqa: E402
from pdserve.model.deepseek_v4.layers import join_rows, joined_rows  # noqa: E402
from pdserve.model.deepseek_v4.step import decode_group_plan  # noqa: E402
from tests.helpers.kernels import DEVICE, require_interpreter, seed_of  # noqa: E402

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


@pytest.mark.parametrize("overlap,dim,m", [(True, 40, 4), (False, 24, 16), (True, 16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_decode_is_the_modules_update(overlap, dim, m, dtype):
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
    try:
        ops.set_backend("torch")
        with torch.no_grad():
            comp.update(x, ix, slots, entries, states)
        ops.set_backend("triton")
        with torch.no_grad():
            comp.update(x, ix, slots, got_entries, got_states)
    finally:
        ops.set_backend(None)
    rows = plan.slot.long()
    ulp = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got_entries[rows].float(), entries[rows].float(), rtol=ulp, atol=1e-5)
    assert got_entries[rows].isfinite().all()
    torch.testing.assert_close(got_states.float(), states.float(), rtol=ulp, atol=1e-5)  # -inf gates equal too
    if dtype != torch.float32:
        assert (got_entries[rows] != entries[rows]).float().mean() <= 0.02
        assert (got_states != states).float().mean() <= 0.01


def test_compress_decode_refuses_a_state_of_another_size():
    kv = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="compress_decode"):
        ops.compress_decode(kv, kv, torch.zeros(4, 10, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                            torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(4, 8, device=DEVICE), 8, False)  # fmt: skip
