"""The KV block copy (kernels/block_copy.py) against plain indexing, byte for byte: odd word
counts (masked tails), several programs a block, layer groups with a masked tail, pools of
different sizes, every word width a block's bytes are viewed as, and every word outside the copied
blocks left as it was. On a GPU also the same-host copy's launch (BoundCopy): compiled once, on
its stream, ids read from pinned host memory by address.

Runs under the Triton interpreter without CUDA (TRITON_INTERPRET is set before the first triton
import: see test_kernels_sparse_mla.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import pdserve_kernels.block_copy as block_copy  # noqa: E402
from pdserve_kernels.ref import copy_blocks_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def random_words(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),),
        generator=gen,
        dtype=torch.uint8,
    )
    return raw.view(dtype).view(shape).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize(
    "L, W, pairs", [(1, 5, [(3, 0)]), (3, 37, [(7, 2), (2, 9), (3, 10), (11, 0)]), (2, 300, [(0, 5), (1, 4), (5, 1)])]
)
def test_copy_blocks_matches_indexing_and_touches_nothing_else(monkeypatch, dtype, L, W, pairs):
    monkeypatch.setattr(block_copy, "BLOCK_WORDS", 64)  # W = 300: five programs a block, a masked tail
    monkeypatch.setattr(block_copy, "LAYER_GROUP", 2)  # L = 3: two layer groups, the second half masked
    src = random_words((L, 12, W), dtype, seed=1)
    dst = random_words((L, 13, W), dtype, seed=2)  # the poison: a word the kernel must not write keeps it
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=DEVICE)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.int32, device=DEVICE)
    want = dst.clone()
    copy_blocks_ref(src, want, src_ids, dst_ids)
    block_copy.copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst, want)
    untouched = [b for b in range(13) if b not in dst_ids.tolist()]
    assert torch.equal(dst[:, untouched], random_words((L, 13, W), dtype, seed=2)[:, untouched])


def test_copy_blocks_takes_strided_layers_and_refuses_mismatched_shapes():
    # a region viewed as [L, N, W] out of a larger tensor: layer stride > N * W
    base = random_words((2, 9, 20), torch.int32, seed=3)
    src, dst = base[:, :6], random_words((2, 4, 20), torch.int32, seed=4)
    ids_s, ids_d = torch.tensor([5, 0], device=DEVICE), torch.tensor([1, 3], device=DEVICE)
    want = dst.clone()
    copy_blocks_ref(src, want, ids_s, ids_d)
    block_copy.copy_blocks(src, dst, ids_s, ids_d)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="copy_blocks"):
        block_copy.copy_blocks(src, random_words((2, 4, 21), torch.int32, seed=5), ids_s, ids_d)
    with pytest.raises(ValueError, match="copy_blocks"):
        block_copy.copy_blocks(src, dst, ids_s, ids_d[:1])
    block_copy.copy_blocks(src, dst, ids_s[:0], ids_d[:0])  # nothing to copy: no launch
    assert torch.equal(dst, want)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="pinned host ids and the compiled-kernel launch need CUDA (run on the H100 / H200)",
)
def test_bound_copy_reads_pinned_host_ids_by_address_on_its_stream():
    """BoundCopy (the same-host copy's launch): compiled once, then ids passed as addresses into a
    pinned ring (device_address), queued on its stream; n = 1 and 16 (values Triton would
    specialize on), a pool of another size; an unaligned id address is refused, not misread."""
    from pdserve.disagg.cuda_ipc import device_address

    stream = torch.cuda.Stream()
    src = random_words((5, 40, 300), torch.int64, seed=6)
    dst = random_words((5, 41, 300), torch.int64, seed=7)
    ring = torch.empty(64, dtype=torch.int64, pin_memory=True)
    base = device_address(ring)
    copy = block_copy.BoundCopy(src, dst, stream)
    torch.cuda.synchronize()  # dst's random words are written before the copy stream reads them
    for k, (n, at) in enumerate([(1, 0), (7, 2), (16, 18), (3, 50)]):  # even offsets: 16-byte aligned
        gen = torch.Generator().manual_seed(k)
        s_ids, d_ids = torch.randperm(40, generator=gen)[:n], torch.randperm(41, generator=gen)[:n]
        d_at = at + n + (n & 1)
        ring[at : at + n], ring[d_at : d_at + n] = s_ids, d_ids
        want = dst.clone()
        copy_blocks_ref(src, want, s_ids, d_ids)
        copy(base + 8 * at, base + 8 * d_at, n)
        stream.synchronize()
        assert torch.equal(dst, want), (n, at)
    with pytest.raises(ValueError, match="aligned"):
        copy(base + 8, base + 16, 1)
