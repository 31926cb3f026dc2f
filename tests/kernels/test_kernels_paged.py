"""The paged modes of the decode and indexer kernels (dense MLA decode and the DSA indexer over
a sequence's positions, slots computed from its block table in the kernel) against float64
references over the same positions' slots.

Runs under the Triton interpreter without CUDA (see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set before the first triton import).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels.indexer import indexer_topk_paged  # noqa: E402
from pdserve_kernels.ref import indexer_topk_ref, paged_slots, sparse_mla_decode_ref  # noqa: E402
from pdserve_kernels.sparse_mla import paged_mla_decode  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, assert_close, poisoned_empty, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def paged_batch(lens: list[int], page: int, n_blocks: int, gen: torch.Generator):
    """Sequences with their context lengths; each gets random distinct blocks of the pool, and
    queries are every sequence's last few positions (a decode token, a prefill chunk's tail)."""
    width = max(-(-n // page) for n in lens)
    perm = torch.randperm(n_blocks, generator=gen)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)  # -1 past a sequence's blocks
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // page)
        tables[b, :k] = perm[used : used + k].to(torch.int32)
        used += k
    seq_ids, ctx = [], []
    for b, n in enumerate(lens):
        for p in range(max(0, n - 3), n):
            seq_ids.append(b)
            ctx.append(p + 1)  # causal: query at position p sees 0..p
    return (
        tables.to(DEVICE),
        torch.tensor(seq_ids, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,page,H,D,d_v",
    [([1, 37, 5], 16, 3, 40, 32), ([70, 9], 4, 20, 72, 64), ([129], 64, 16, 64, 64)],
    ids=["odd-dims", "small-pages", "D=d_v"],
)
@pytest.mark.parametrize("sink", [False, True])
def test_paged_decode_matches_reference(lens, page, H, D, d_v, sink, dtype):
    gen = torch.Generator().manual_seed(sum(lens) + H)
    n_blocks = sum(-(-n // page) for n in lens) + 5
    tables, seq_ids, ctx = paged_batch(lens, page, n_blocks, gen)
    T = len(seq_ids)
    q = torch.randn(T, 1, H, D, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(n_blocks * page, D + 8, generator=gen).to(DEVICE, dtype)[:, :D]  # row stride > D
    sinks = torch.randn(H, generator=gen).to(DEVICE) if sink else None
    max_len, scale = max(lens) + 3, D**-0.5  # max_len may exceed every length
    with poisoned_empty():
        out, lse = paged_mla_decode(q, kv, tables, seq_ids, ctx, page, max_len, scale, d_v, sink=sinks)
    idx = paged_slots(tables, seq_ids, ctx, page, max_len)[:, None]
    want, want_lse = sparse_mla_decode_ref(
        q.double(), kv.double(), idx, scale, d_v, sink=None if sinks is None else sinks.double()
    )
    assert_close(out, want, dtype)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=2e-3, rtol=0)


def test_paged_slots_follow_the_block_table():
    tables = torch.tensor([[7, 2, -1], [0, 5, 9]], dtype=torch.int32)
    slots = paged_slots(
        tables, torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([5, 1, 9], dtype=torch.int32), 4, 10
    )
    assert slots.tolist() == [
        [28, 29, 30, 31, 8, -1, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        [0, 1, 2, 3, 20, 21, 22, 23, 36, -1],
    ]


def test_paged_decode_rejects_bad_metadata():
    q = torch.zeros(2, 1, 4, 16, device=DEVICE)
    kv = torch.zeros(8, 16, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    ok = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_ids must be int32"):
        paged_mla_decode(q, kv, tables, ok.long(), ok, 4, 8, 1.0, 16)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_mla_decode(q, kv, tables.long(), ok, ok, 4, 8, 1.0, 16)
    with pytest.raises(ValueError, match=r"q must be \[T, 1, H, D\]"):
        paged_mla_decode(q.view(1, 2, 4, 16), kv, tables, ok[:1], ok[:1], 4, 8, 1.0, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,page,topk,scale", [([1, 37, 5], 16, 8, 1.0), ([70, 9], 4, 100, 0.03125), ([129], 64, 32, 0.0221)]
)
def test_paged_indexer_matches_reference(lens, page, topk, scale, dtype, monkeypatch):
    """scale: the weights read as weights.float() * scale (DeepSeek-V4's folded Hi^-0.5 * Di^-0.5)."""
    from pdserve_kernels import indexer

    monkeypatch.setattr(indexer, "SCORES_BYTES", 4 * 200 * 2)  # a few rows a chunk: the chunking is exercised
    gen = torch.Generator().manual_seed(sum(lens) * 7 + topk)
    n_blocks = sum(-(-n // page) for n in lens) + 3
    tables, seq_ids, ctx = paged_batch(lens, page, n_blocks, gen)
    T, H, D = len(seq_ids), 4, 32
    q = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(n_blocks * page, D, generator=gen).to(DEVICE, dtype)
    w = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    max_len = max(lens)
    with poisoned_empty():  # -1 padding and every slot written by the kernels
        got = indexer_topk_paged(q, k_cache, w, tables, seq_ids, ctx, page, max_len, topk, weight_scale=scale)
    cand = paged_slots(tables, seq_ids, ctx, page, max_len)
    want = indexer_topk_ref(q.double(), k_cache.double(), w.double() * scale, cand, topk)
    assert got.shape == want.shape == (T, min(topk, max_len)) and got.dtype == torch.int32
    # float64 scores of every candidate slot: exact ties (0.0 when every head's ReLU is 0) may be
    # broken either way, so the chosen scores are compared, not the slots
    logits = torch.relu(torch.einsum("thd,tcd->thc", q.double(), k_cache.double()[cand.clamp(min=0).long()]))
    ref_scores = torch.einsum("th,thc->tc", w.double() * scale, logits)
    for t, (g, w_) in enumerate(zip(got.tolist(), want.tolist())):
        score = {int(c): float(v) for c, v in zip(cand[t], ref_scores[t]) if c >= 0}
        assert g.count(-1) == w_.count(-1) and len(set(g)) == len(g) - max(0, g.count(-1) - 1)
        gv, wv = sorted(score[c] for c in g if c != -1), sorted(score[c] for c in w_ if c != -1)
        tol = 1e-9 if dtype == torch.float32 else 0.05 * max(map(abs, wv), default=1.0)
        assert sum(abs(a - b) > tol for a, b in zip(gv, wv)) <= (0 if dtype == torch.float32 else 2), (t, gv, wv)


@pytest.mark.parametrize("C,k,tile", [(70, 9, 16), (70, 70, 4096), (33, 20, 4096), (200, 64, 64), (5, 1, 4096)])
def test_select_slots_ties_and_long_rows(C, k, tile, monkeypatch):
    """The one-launch top-k: scores with many exact ties at the k-th value (small integers, +0 and
    -0, negatives), -inf tails shorter and longer than k, and rows longer than a tile (tile < C:
    the k-th largest from torch, the compaction over several tiles). Checked against torch.topk in float64: the same multiset of chosen values,
    each chosen position distinct and of its row's top k, -1 exactly for chosen -inf; poisoned out."""
    from pdserve_kernels import indexer

    monkeypatch.setattr(indexer, "SELECT_TILE", tile)
    gen = torch.Generator().manual_seed(C * 131 + k)
    T, page = 6, 8
    scores = torch.randint(-3, 4, (T, C), generator=gen).double()
    scores[1] = torch.randn(C, generator=gen).double()  # no ties
    scores[2, C // 2 :] = float("-inf")  # a short context: fewer candidates than k for some k
    scores[3] = 0.0
    scores[3, ::2] = -0.0
    scores[5, : C // 3] = -0.0  # the k-th largest may be a -0 among +0s: equal keys
    scores[5, C // 3 :] = 0.0
    scores[5, -1] = 1.0
    scores[4, 1:] = float("-inf")
    width = -(-C // page)
    tables = torch.randperm(T * width, generator=gen).view(T, width).to(torch.int32)
    seq = torch.randperm(T, generator=gen).to(torch.int32)
    out = torch.full((T, k), -7, dtype=torch.int32)  # poison
    got = indexer.select_slots(
        scores.float().to(DEVICE), tables.to(DEVICE), seq.to(DEVICE), page, k, out.to(DEVICE)
    ).cpu()
    want = scores.topk(k, dim=1).values
    for t in range(T):
        slot_to_pos = {int(tables[seq[t], p // page]) * page + p % page: p for p in range(C)}
        real = [s for s in got[t].tolist() if s != -1]
        assert len(set(real)) == len(real) and all(s in slot_to_pos for s in real), got[t]
        vals = sorted([float(scores[t, slot_to_pos[s]]) for s in real] + [float("-inf")] * (k - len(real)))
        assert vals == sorted(want[t].tolist()), (t, vals)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def tiny_model(request, tmp_path_factory):
    from pdserve.model.loader import load_model
    from pdserve.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)
    return load_model(path, dtype=torch.float32, device=DEVICE, progress=False)


def test_tiny_models_run_through_the_kernels(tiny_model):
    """The engine's attention path on the Triton kernels (paged decode, expanded prefill, paged
    indexer + sparse decode for V3.2; the interpreter on CPU) gives the torch references' logits:
    a prompt prefilled in two chunks beside another sequence's decode steps (float32)."""
    from pdserve.model import ops
    from tests.helpers.model import PagedHarness, Seq

    a_prompt, b_prompt = [(7 * i + 3) % 200 + 1 for i in range(11)], [(5 * i + 1) % 200 + 1 for i in range(6)]

    def run(backend: str) -> torch.Tensor:
        ops.set_backend(backend)
        try:
            h = PagedHarness(tiny_model, num_blocks=16, block_size=4, seed=3)
            h.kv = type(h.kv)(tiny_model.kv_cache_specs(), tiny_model.num_layers, 16, 4, torch.float32, DEVICE)
            a, b = Seq(), Seq()
            out = h.step([(b, b_prompt)])
            out += h.step([(a, a_prompt[:6]), (b, [9])])
            out += h.step([(b, [11]), (a, a_prompt[6:])])
            return torch.cat(out)
        finally:
            ops.set_backend(None)

    want, got = run("torch"), run("triton")
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_paged_decode_reads_fp8_records():
    """The paged mode over 656-byte FP8 records (V3.2 layout: 512 e4m3 + scales + 64 bf16 rope)."""
    from pdserve_kernels import kv_fp8

    gen = torch.Generator().manual_seed(11)
    lens, page, H = [40, 3, 17], 16, 16
    n_blocks = sum(-(-n // page) for n in lens) + 2
    tables, seq_ids, ctx = paged_batch(lens, page, n_blocks, gen)
    q = torch.randn(len(seq_ids), 1, H, 576, generator=gen).to(DEVICE, torch.float16)
    records = kv_fp8.pack_kv_fp8(torch.randn(n_blocks * page, 576, generator=gen), 512).to(DEVICE)
    with poisoned_empty():
        out, lse = paged_mla_decode(q, records, tables, seq_ids, ctx, page, max(lens), 576**-0.5, 512)
    idx = paged_slots(tables, seq_ids, ctx, page, max(lens))[:, None]
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_ref(q.double(), records, idx, 576**-0.5, 512)
    assert_close(out, want, torch.float16)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=2e-3, rtol=0)
