"""Block gather / scatter (kernels/block_copy.py) against torch's index_select / index_copy_: every
word of the moved blocks, nothing else touched, odd word counts and tile tails.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import block_copy  # noqa: E402
from pdserve_kernels.block_copy import gather_blocks, scatter_blocks  # noqa: E402
from tests.kernel_util import DEVICE, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


@pytest.mark.parametrize("L,N,W,dtype", [(3, 11, 37, torch.int64), (2, 9, 2 * block_copy.BLOCK + 5, torch.int32), (1, 4, 1, torch.int16)])
def test_gather_then_scatter_moves_exactly_the_blocks(L, N, W, dtype):
    gen = torch.Generator().manual_seed(L * 100 + W)
    info = torch.iinfo(dtype)
    src = torch.randint(info.min, info.max, (L, N, W), generator=gen, dtype=torch.int64).to(dtype).to(DEVICE)
    ids = torch.randperm(N, generator=gen)[: max(1, N // 2)].to(DEVICE)
    slab = torch.full((L, ids.numel(), W), -1, dtype=dtype, device=DEVICE)  # poisoned
    gather_blocks(src, ids, slab)
    assert torch.equal(slab.cpu(), torch.index_select(src.cpu(), 1, ids.cpu()))
    dst = torch.full_like(src, 7)
    scatter_blocks(slab, ids.to(torch.int32), dst)
    want = torch.full_like(src.cpu(), 7).index_copy_(1, ids.cpu(), slab.cpu())
    assert torch.equal(dst.cpu(), want)  # the other blocks untouched


def test_refuses_mismatched_shapes():
    src = torch.zeros(2, 5, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="block ids"):
        gather_blocks(src, torch.tensor([0, 1], device=DEVICE), torch.zeros(2, 3, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        gather_blocks(src, torch.tensor([0], device=DEVICE), torch.zeros(2, 1, 8, dtype=torch.int32, device=DEVICE))
