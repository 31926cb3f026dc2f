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
from tests.kernel_util import DEVICE, DTYPES, poisoned_empty, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def ref_scores(q, k_cache, weights, candidates):
    keys = k_cache.double()[candidates.clamp(min=0).long()]
    logits = torch.relu(torch.einsum("thd,tcd->thc", q.double(), keys))
    scores = torch.einsum("th,thc->tc", weights.double(), logits)
    return scores.masked_fill(candidates < 0, float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D,N,C,topk", [(3, 4, 32, 60, 40, 10), (2, 20, 48, 90, 70, 100),
                                            (1, 64, 128, 50, 17, 5)])
def test_topk_matches_reference(T, H, D, N, C, topk, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + C)
    q = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(N, D + 8, generator=gen).to(DEVICE, dtype)[:, :D]  # row stride > D
    weights = torch.randn(T, H, generator=gen).to(DEVICE)
    cand = torch.randint(0, N, (T, C), generator=gen, dtype=torch.int32)
    cand[0, C // 2:] = -1  # fewer candidates than topk for some queries
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
