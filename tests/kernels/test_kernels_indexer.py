"""DSA indexer scores (Triton) + top-k against a float64 reference.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import configs  # noqa: E402
from pdserve_kernels.indexer import index_scores, indexer_topk  # noqa: E402
from pdserve_kernels.ref import indexer_topk_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, poisoned_empty, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def ref_scores(q, k_cache, weights, candidates):
    keys = k_cache.double()[candidates.clamp(min=0).long()]
    logits = torch.relu(torch.einsum("thd,tcd->thc", q.double(), keys))
    scores = torch.einsum("th,thc->tc", weights.double(), logits)
    return scores.masked_fill(candidates < 0, float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D,N,C,topk", [(3, 4, 32, 60, 40, 10), (2, 20, 48, 90, 70, 100), (1, 64, 128, 50, 17, 5)])
def test_topk_matches_reference(T, H, D, N, C, topk, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + C)
    q = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(N, D + 8, generator=gen).to(DEVICE, dtype)[:, :D]  # row stride > D
    weights = torch.randn(T, H, generator=gen).to(DEVICE)
    cand = torch.randint(0, N, (T, C), generator=gen, dtype=torch.int32)
    cand[0, C // 2 :] = -1  # fewer candidates than topk for some queries
    if T > 2:
        cand[2] = -1  # nothing at all
    cand = cand.to(DEVICE)
    with poisoned_empty():
        scores = index_scores(q, k_cache, weights, cand)
    want = ref_scores(q, k_cache, weights, cand)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(scores))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(scores[fin].double(), want[fin], rtol=tol, atol=tol * want.abs()[fin].max().item())

    got = indexer_topk(q, k_cache, weights, cand, topk)
    expect = indexer_topk_ref(q.double(), k_cache.double(), weights.double(), cand, topk)
    assert got.shape == expect.shape == (T, min(topk, C)) and got.dtype == torch.int32
    assert torch.equal(got == -1, expect == -1)  # same number of valid picks per query
    # the picked candidates' true scores are the top scores (ties may pick other ids)
    for t in range(T):
        n = int((got[t] >= 0).sum())
        pos = {int(c): i for i, c in enumerate(cand[t].tolist())}
        picked = want[t, [pos[int(c)] for c in got[t, :n].tolist()]]
        torch.testing.assert_close(picked, want[t].topk(n).values, rtol=tol, atol=tol * 10)


def test_rejects_bad_inputs():
    q = torch.randn(2, 4, 16, device=DEVICE)
    k = torch.randn(10, 16, device=DEVICE)
    w = torch.randn(2, 4, device=DEVICE)
    cand = torch.zeros(2, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        indexer_topk(q, k, w, cand.long(), 3)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(q, k, w[:, :2], cand, 3)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, k, w, cand, 0)


def test_sm120_config_fits_shared_memory():
    cfg = configs.indexer_config(120)
    assert configs.indexer_smem_bytes(cfg, heads=64, dim=128) <= configs.SMEM_LIMIT[120]


def check_picks(got, cand, want, tol):
    """The picked candidates are valid and their true scores are the top ones (ties may pick
    other ids); as many picks as the query has candidates with a finite score, up to k."""
    for t in range(got.shape[0]):
        n = int((got[t] >= 0).sum())
        assert n == min(got.shape[1], int(torch.isfinite(want[t]).sum()))
        assert bool((got[t, n:] == -1).all())
        pos = {int(c): i for i, c in enumerate(cand[t].tolist()) if c >= 0}
        picked = want[t, [pos[int(c)] for c in got[t, :n].tolist()]]
        torch.testing.assert_close(picked, want[t].topk(n).values, rtol=tol, atol=tol * 10)


def v4_candidates(lens, starts, rate):
    """Causal candidates as DeepSeek-V4 builds them (deepseek_v4/step.py): the step's index
    keys are every sequence's entries, concatenated; a query at position p may see entry e of its
    own sequence when e < (p + 1) // rate; -1 elsewhere (trailing). -> [T, Em] int32, key rows."""
    counts = [(n + ln) // rate for n, ln in zip(starts, lens)]
    rows = []
    for b, (n, ln) in enumerate(zip(starts, lens)):
        for p in range(n, n + ln):
            seen = (p + 1) // rate
            rows.append([sum(counts[:b]) + e if e < seen else -1 for e in range(max(counts))])
    return torch.tensor(rows, dtype=torch.int32), sum(counts)


# (H, D, lens, starts, topk): V4-Flash's indexer (64 heads x 128), odd H, a chunk of prefill next
# to decode tokens, queries that see no entry yet (p < rate - 1), top-k below and above what a
# query may see
V4_CASES = [
    (64, 128, [1, 1], [37, 12], 4),
    (7, 32, [6, 1, 2], [0, 21, 9], 3),
    (20, 48, [9], [2], 50),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,lens,starts,topk", V4_CASES)
def test_v4_causal_candidates_match_reference(H, D, lens, starts, topk, dtype):
    gen = torch.Generator().manual_seed(H * 100 + D)
    cand, N = v4_candidates(lens, starts, rate=4)
    T = cand.shape[0]
    q = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)
    keys = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
    weights = torch.randn(T, H, generator=gen).to(DEVICE) * (H**-0.5 * D**-0.5)  # scales folded in
    cand = cand.to(DEVICE)
    with poisoned_empty():
        got = indexer_topk(q, keys, weights, cand, topk)
    expect = indexer_topk_ref(q.double(), keys.double(), weights.double(), cand, topk)
    assert got.shape == expect.shape == (T, min(topk, cand.shape[1])) and got.dtype == torch.int32
    assert torch.equal(got == -1, expect == -1)
    check_picks(got, cand, ref_scores(q, keys, weights, cand), 1e-5 if dtype == torch.float32 else 2e-2)


def test_folded_weights_pick_what_transformers_scores_pick():
    """DeepSeek-V4's scorer as transformers writes it, relu(q . k) * Di^-0.5 summed with weights
    * Hi^-0.5, future entries -inf, picks of a -inf score made -1, selects the same entries as
    the kernel's contract with both scales folded into the weights (float64; ties excluded by
    16 heads, as in the tiny models)."""
    gen = torch.Generator().manual_seed(9)
    H, D, topk = 16, 32, 3
    cand, N = v4_candidates([10, 1], [0, 30], rate=4)
    q = torch.randn(cand.shape[0], H, D, generator=gen, dtype=torch.float64)
    keys = torch.randn(N, D, generator=gen, dtype=torch.float64)
    w = torch.randn(cand.shape[0], H, generator=gen, dtype=torch.float64)
    got = indexer_topk_ref(q, keys, w * H**-0.5 * D**-0.5, cand, topk)
    for t in range(cand.shape[0]):
        scores = (torch.relu(q[t] @ keys[cand[t].clamp(min=0).long()].T) * D**-0.5 * (w[t, :, None] * H**-0.5)).sum(0)
        scores = scores.masked_fill(cand[t] < 0, float("-inf"))
        top = scores.topk(min(topk, cand.shape[1]))
        want = torch.where(torch.isinf(top.values), -1, cand[t][top.indices])
        assert sorted(got[t].tolist()) == sorted(want.tolist())
