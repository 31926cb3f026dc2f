"""DeepSeek-V4's compressor update over a general step's plan in two kernels (kernels/compress.py's
`compress_chunk`: pooling, then the records) against the module's own torch path
(`CompressedKV.update`, which the engine tests check against transformers), on plans that
`step.group_plan` builds from random batches: verify chunks (2..4 tokens at random starts that
cross group edges), prefill chunks from 0 and from the middle of a group, a mixed step (chunks of
different lengths, one-token rows among them), and a decode plan (`step.decode_group_plan`) whose
records go to spare slots; an overlapping (CSA) rate-4 compressor and a
non-overlapping (HCA-like) rate-8 one, odd Dc; fp32 and bf16 (states bf16 or float32); the new
records written to spare slots (verify, decode and prefill: the records read then stay as they
were) or in place (a chunk from the middle of a group, the mixed step). Entries and
states are poisoned (NaN) first: an element left unwritten fails. The entries within the roundings
on their path, end to end and stage by stage, and the records equal bit for bit, as in
test_kernels_v4_compress.py (`_entries_close`).

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from pdserve.model.deepseek_v4.compressor import CompressedKV  # noqa: E402
from pdserve.model.deepseek_v4.layers import join_rows  # noqa: E402
from pdserve.model.deepseek_v4.step import decode_group_plan, group_plan  # noqa: E402
from tests.helpers.kernels import DEVICE, require_interpreter, seed_of  # noqa: E402
from tests.kernels.test_kernels_v4_compress import _entries_close, _pooled_terms, _update  # noqa: E402

pytestmark = pytest.mark.timeout(600)
require_interpreter()
HIDDEN, BS, S = 48, 16, 24  # S state slots


class _Rope:
    def __call__(self, positions):
        p = positions.float()[:, None] * torch.arange(1, 5, device=positions.device) / 50
        return p.cos(), p.sin()  # R = 8


def _chunks(kind: str, m: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """(starts, lens) of one step's sequences."""
    if kind == "verify":  # k + 1 = 2..4 tokens a sequence, starts at every place in a group
        starts = [0, 1, m - 1, m, 2 * m - 2, 3 * m - 1] + torch.randint(0, 6 * m, (3,), generator=g).tolist()
        return starts, torch.randint(2, 5, (len(starts),), generator=g).tolist()
    if kind == "prefill":  # whole prompts: shorter than a group, a group, several and a bit
        return [0, 0, 0], [m - 1, m, 3 * m + 2]
    if kind == "decode":  # one token a sequence (a step of verify chunks without drafts)
        return [0, 1, m - 1, m, 2 * m + 1, 5 * m - 1], [1] * 6
    if kind == "chunked":  # a chunk of a long prompt, from the middle of a group
        return [m + 2, 2 * m, 5], [2 * m + 1, m + 3, 1]
    return [7, 0, 3 * m, 2 * m + 1, 4 * m - 1], [1, 2 * m + 3, 1, 5, 1]  # mixed: decodes beside prefill chunks


def _module(dim: int, m: int, overlap: bool, dtype, g: torch.Generator) -> CompressedKV:
    comp = CompressedKV(HIDDEN, dim, m, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    comp = comp.to(DEVICE, dtype)
    comp.position_bias.data, comp.kv_norm.weight.data = (
        comp.position_bias.data.float(),
        comp.kv_norm.weight.data.float(),
    )
    if overlap:  # the loader's joined projections: the kernels read the strided halves of one GEMM's output
        join_rows(comp.kv_proj, comp.gate_proj)
    return comp


def _state_dim(dim, m, overlap):
    C = 2 * dim if overlap else dim
    return 2 * (m - 1) * C + (2 * m * dim if overlap else 0)


@pytest.mark.parametrize("kind", ["verify", "decode", "prefill", "chunked", "mixed"])
@pytest.mark.parametrize("overlap,dim,m", [(True, 37, 4), (False, 19, 8)])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_compress_chunk_is_the_modules_update(kind, overlap, dim, m, dtype, state_dtype, monkeypatch):
    spare = kind in (
        "verify",
        "decode",
        "prefill",
    )  # else in place: several groups of a sequence read the record it rewrites
    g = torch.Generator().manual_seed(seed_of("compress_chunk", kind, overlap, dim, m, dtype, state_dtype, spare))
    comp = _module(dim, m, overlap, dtype, g)
    starts, lens = _chunks(kind, m, g)
    B, T, width = len(starts), sum(lens), 16
    n, L = torch.tensor(starts, device=DEVICE), torch.tensor(lens, device=DEVICE)
    table = (torch.randperm(B * width * 2, generator=g)[: B * width].view(B, width)).to(DEVICE, torch.int32)
    page = BS // m
    if kind == "decode":  # the decode plan; with spare slots the update takes the two kernels too
        batch = SimpleNamespace(starts=n, decode_rows=torch.arange(B, device=DEVICE))
        plan = decode_group_plan(batch, m, table, page, _Rope())
    else:
        plan = group_plan(SimpleNamespace(starts=n, lens=L, num_tokens=T), m, table, page, False, _Rope())
    ix = SimpleNamespace(groups=plan)
    x = torch.randn(T, HIDDEN, generator=g).to(DEVICE, dtype)
    states = torch.randn(S, _state_dim(dim, m, overlap), generator=g).to(DEVICE, state_dtype)
    perm = torch.randperm(S, generator=g).to(DEVICE)
    slots, dst = perm[:B], (perm[B : 2 * B] if spare else None)
    if spare:
        states[dst] = float("nan")  # the spare records must be written whole
    entries = torch.full((2 * B * width * page, dim), float("nan"), device=DEVICE, dtype=dtype)
    got_states, got_entries, before = states.clone(), entries.clone(), states.clone()
    terms = _pooled_terms(comp, monkeypatch, x, ix, slots, entries, states, dst=dst)
    want_pooled = _update(comp, "torch", monkeypatch, x, ix, slots, entries, states, dst=dst)
    got_pooled = _update(comp, "triton", monkeypatch, x, ix, slots, got_entries, got_states, dst=dst)
    rows = plan.slot.long()
    assert got_entries[rows].isfinite().all()
    _entries_close(got_entries[rows], entries[rows], got_pooled, want_pooled, terms, comp, plan.rope, dtype)
    assert got_entries.isnan().sum() == entries.isnan().sum()  # no other entry written
    out = dst if spare else slots
    assert not got_states[out].isnan().any()
    # the records: copies of the rows and gate + bias (float32), each rounded once to the state's
    # dtype from the same float32 value on both sides, no float32 difference before it (-inf gates too)
    assert torch.equal(got_states, states), "the state records, bit for bit"
    if spare:  # the records read are untouched
        assert torch.equal(got_states[slots], before[slots]) and torch.equal(states[slots], before[slots])
    if dtype != torch.float32:
        assert (got_entries[rows] != entries[rows]).float().mean() <= 0.02
