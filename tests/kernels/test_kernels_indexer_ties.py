"""Equal index scores: every top-k (the paged and the candidate-list kernels, and the torch
reference the CPU runs) takes the ties at the k-th score in position order, whatever the row's
length. ReLU'd scores tie exactly at 0 (-0 too, from a negative head weight) whenever fewer than
k entries score above 0; torch.topk's pick among them changed with the row's length, so a decode
step and a prefill of the same prefix read different entries (issue 39)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels.indexer import indexer_topk, indexer_topk_paged  # noqa: E402
from pdserve_kernels.ref import indexer_topk_paged_ref, indexer_topk_ref, topk_first  # noqa: E402
from tests.helpers.kernels import DEVICE, poisoned_empty, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def test_topk_first_takes_ties_in_position_order():
    x = torch.tensor([[0.5, -0.0, 0.0, -0.0, 0.3, float("-inf"), 0.0, 0.3]])
    top = topk_first(x, 5)
    assert top.indices.tolist() == [[0, 4, 7, 1, 2]]  # 0.3 at 4 before 7; then the zeros from 1 on, -0 as +0
    assert torch.equal(top.values, x[:, [0, 4, 7, 1, 2]])
    longer = torch.cat([x, torch.full((1, 100), float("-inf"))], dim=1)  # a longer row: the same picks
    assert torch.equal(topk_first(longer, 5).indices, top.indices)


def tied_keys(gen: torch.Generator, n: int, positive: list[int], dim: int) -> torch.Tensor:
    """[n, dim] keys: rows `positive` random, the rest zero (every head's dot 0: score exactly 0)."""
    keys = torch.zeros(n, dim)
    keys[positive] = torch.randn(len(positive), dim, generator=gen)
    return keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_paged_kernel_takes_zero_ties_in_position_order(seed, dtype):
    """Two sequences, queries at several lengths; fewer entries score above 0 than k, so the
    picks go on into the zeros: the same slots as the reference, and the zeros' lowest positions."""
    gen = torch.Generator().manual_seed(seed)
    H, D, page, k = 4, 32, 4, 6
    N = 64
    positive = torch.randperm(N, generator=gen)[:3].tolist()
    keys = tied_keys(gen, N, positive, D).to(DEVICE, dtype)
    tables = torch.randperm(N // page, generator=gen)[: 2 * 8].view(2, 8).to(torch.int32)
    lens = torch.tensor([9, 17, 30, 31, 12, 32], dtype=torch.int32)
    seq = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    T = len(lens)
    q = torch.randn(T, H, D, generator=gen)
    q[:, 0] = -q[:, 0]  # a head whose dots differ in sign from the others'
    q = q.to(DEVICE, dtype)
    w = torch.randn(T, H, generator=gen).to(DEVICE)  # negative weights make -0 scores
    args = (tables.to(DEVICE), seq.to(DEVICE), lens.to(DEVICE), page)
    want = indexer_topk_paged_ref(q.double(), keys.double(), w.double(), *args, 32, k)
    for max_len in (32, 96):  # the row's length must not change the picks
        with poisoned_empty():
            got = indexer_topk_paged(q, keys, w, *args, max_len, k)
        assert torch.equal(got.sort(dim=1).values.cpu(), want.sort(dim=1).values.cpu()), max_len
        assert torch.equal(indexer_topk_paged_ref(q, keys, w, *args, max_len, k), want.to(got.device))


def test_candidate_kernel_takes_zero_ties_in_position_order():
    gen = torch.Generator().manual_seed(7)
    T, H, D, N, k = 3, 4, 16, 40, 5
    keys = tied_keys(gen, N, [3, 17], D).to(DEVICE)
    q, w = torch.randn(T, H, D, generator=gen).to(DEVICE), torch.rand(T, H, generator=gen).to(DEVICE)
    cand = torch.stack([torch.randperm(N, generator=gen)[:20] for _ in range(T)]).to(torch.int32).to(DEVICE)
    got = indexer_topk(q, keys, w, cand, k)
    want = indexer_topk_ref(q.double(), keys.double(), w.double(), cand, k)
    assert torch.equal(got, want)
    for t in range(T):  # the zero-score picks are the first zero-score candidates in list order
        zeros = [int(c) for c in cand[t].tolist() if c not in (3, 17)]
        picked_zeros = [int(c) for c in got[t].tolist() if c not in (3, 17)]
        assert picked_zeros == zeros[: len(picked_zeros)]
