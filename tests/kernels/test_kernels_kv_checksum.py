"""The KV checksum kernel (kernels/kv_checksum.py) against numpy uint64 arithmetic over the raw
bytes (never through pdserve/disagg/checksum.py): every word width a block's bytes are viewed as,
odd block and layer counts (several programs a block, a masked layer group), ids in many runs and
in one, -1 padding, slab parts (no ids), a flipped bit anywhere in the request always detected and
one outside it never; and checksum.py's kernel path (pools with several regions and word types,
slabs) giving the same numbers as the reference and as its torch path.

Runs under the Triton interpreter without CUDA (TRITON_INTERPRET is set before the first triton
import: see test_kernels_sparse_mla.py).
"""

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve.disagg.checksum import (  # noqa: E402
    pool_block_checksums,
    pool_checksums,
    slab_block_checksums,
    slab_checksums,
    totals,
)
from pdserve.disagg.layout import KVLayout  # noqa: E402
from pdserve.disagg.staging import gather, slab_parts  # noqa: E402
from pdserve.model.kv_cache import KVCache, KVRegionSpec  # noqa: E402
from pdserve_kernels.kv_checksum import checksum_blocks  # noqa: E402
from pdserve_kernels.ref import checksum_blocks_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()

NP_WORD = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}


def reference(raw: np.ndarray, word: type, ids: list[int]) -> int:
    """The checksum of blocks ids of raw uint8 [L, N, block bytes] read as `word`s, in numpy uint64
    (wrapping mod 2^64): per (layer l, position i) the block's word sum (each word sign- or
    zero-extended to 64 bits) times 2 * (l * n + i) + 1, all summed; as a signed int64."""
    L, n = raw.shape[0], len(ids)
    words = np.ascontiguousarray(raw[:, ids, :]).view(word).astype(np.int64).astype(np.uint64)  # [L, n, W]
    sums = words.sum(axis=-1, dtype=np.uint64)
    weights = np.arange(L * n, dtype=np.uint64).reshape(L, n) * np.uint64(2) + np.uint64(1)
    v = int((sums * weights).sum(dtype=np.uint64))
    return v - (1 << 64) if v >= 1 << 63 else v


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def kernel_sum(words: torch.Tensor, ids: list[int] | None, n: int | None = None, id_dtype=torch.int64) -> int:
    acc = torch.full((3,), 7, dtype=torch.int64, device=DEVICE)  # poison beside the accumulator
    acc[1] = 0
    t = None if ids is None else torch.tensor(ids, dtype=id_dtype, device=DEVICE)
    checksum_blocks(words, t, acc[1:2], n)
    assert acc[0].item() == 7 and acc[2].item() == 7, "the kernel wrote beside its accumulator"
    return acc[1].item()


IDS = {
    "one": [4],
    "runs": [2, 3, 4, 10, 11, 17],  # three runs of consecutive ids
    "scattered": [16, 0, 9, 5, 12, 1, 20, 7, 3],  # odd count, 9 runs, out of order
}


@pytest.mark.parametrize("word", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("L, block_bytes", [(1, 200), (3, 200), (5, 72)])
@pytest.mark.parametrize("which", list(IDS))
def test_checksum_blocks_matches_numpy_over_the_bytes(word, L, block_bytes, which):
    # the interpreter's tile: 64 bytes a program, 2 layers; 200 bytes = 4 programs a block, the
    # last masked; L = 3 and 5: the last layer group half masked. uint8 words on odd block bytes.
    block_bytes += 1 if word == torch.uint8 else 0
    raw = random_bytes((L, 23, block_bytes), seed_of(str(word), L, block_bytes, which))
    words = raw.view(word).to(DEVICE)
    ids = IDS[which]
    want = reference(raw.numpy(), NP_WORD[word], ids)
    assert kernel_sum(words, ids) == want
    assert kernel_sum(words, ids, id_dtype=torch.int32) == want
    acc = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    checksum_blocks_ref(words, torch.tensor(ids, device=DEVICE), acc)
    assert acc.item() == want
    # per block: block i's terms alone in acc[i] (poison after the last), the same as the reference's
    per = torch.full((len(ids) + 1,), 7, dtype=torch.int64, device=DEVICE)
    per[:-1] = 0
    checksum_blocks(words, torch.tensor(ids, device=DEVICE), per, per_block=True)
    ref = torch.zeros(len(ids), dtype=torch.int64, device=DEVICE)
    checksum_blocks_ref(words, torch.tensor(ids, device=DEVICE), ref, per_block=True)
    assert per[-1].item() == 7 and torch.equal(per[:-1], ref)
    assert (int(per[:-1].sum()) + (1 << 63)) % (1 << 64) - (1 << 63) == want


def test_checksum_blocks_skips_minus_one_padding_and_sums_slab_parts():
    raw = random_bytes((3, 11, 96), seed_of("pad"))
    words = raw.view(torch.int64).to(DEVICE)
    ids = [7, 2, 9, 3, 10]
    want = reference(raw.numpy(), np.int64, ids)
    assert kernel_sum(words, [*ids, -1, -1, -1], n=len(ids)) == want  # a padded id tensor
    assert kernel_sum(words, [-1, -1], n=0) == 0
    assert kernel_sum(words, None) == reference(raw.numpy(), np.int64, list(range(11)))  # a slab part
    assert kernel_sum(words, []) == 0  # nothing to sum: no launch, the accumulator as it was
    # a region viewed out of a larger tensor: layer stride > N * W (the words of blocks 11.. unread)
    big = random_bytes((3, 15, 96), seed_of("strided"))
    assert kernel_sum(big.view(torch.int64)[:, :11].to(DEVICE), ids) == reference(big.numpy(), np.int64, ids)


def test_checksum_blocks_refuses_what_it_cannot_sum():
    words = random_bytes((2, 4, 16), 0).view(torch.int64).to(DEVICE)
    acc = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="integer words"):
        checksum_blocks(words.view(torch.float64), None, acc)
    with pytest.raises(ValueError, match="integer words"):
        checksum_blocks(words[:, :, ::2], None, acc)
    with pytest.raises(ValueError, match="int64"):
        checksum_blocks(words, None, acc.int())
    with pytest.raises(ValueError, match="ids"):
        checksum_blocks(words, torch.tensor([0.0], device=DEVICE), acc)


@pytest.mark.parametrize("word, block_bytes", [(torch.int64, 144), (torch.uint8, 45)])
def test_a_flipped_bit_in_the_request_is_always_detected_and_one_outside_never(word, block_bytes):
    L, N = 3, 13
    raw = random_bytes((L, N, block_bytes), seed_of("flip", str(word)))
    words = raw.view(word).to(DEVICE)
    ids = [11, 2, 3, 7, 0]
    base = kernel_sum(words, ids)
    assert base == reference(raw.numpy(), NP_WORD[word], ids)
    gen = torch.Generator().manual_seed(seed_of("flips", str(word)))
    flat = words.view(torch.uint8)  # the same storage, as bytes [L, N, block_bytes]
    for trial in range(24):
        inside = trial % 3 != 2
        pool = ids if inside else [b for b in range(N) if b not in ids]
        layer, b = int(torch.randint(L, (1,), generator=gen)), pool[int(torch.randint(len(pool), (1,), generator=gen))]
        byte, bit = int(torch.randint(block_bytes, (1,), generator=gen)), int(torch.randint(8, (1,), generator=gen))
        flat[layer, b, byte] ^= 1 << bit
        got = kernel_sum(words, ids)
        assert (got != base) == inside, (layer, b, byte, bit)
        flat[layer, b, byte] ^= 1 << bit
    assert kernel_sum(words, ids) == base


def random_kv(specs: list[KVRegionSpec], layers: int, blocks: int, block_size: int, seed: int) -> KVCache:
    kv = KVCache(specs, layers, blocks, block_size, torch.bfloat16, DEVICE)
    for k, t in enumerate(kv.regions.values()):
        t.view(torch.uint8).copy_(random_bytes(tuple(t.view(torch.uint8).shape), seed + k))
    return kv


def word_of(block_bytes: int) -> type:
    """The word type a block of this many bytes is read as: the widest integer size dividing it."""
    return (
        next(w for s, w in ((8, np.int64), (4, np.int32), (2, np.int16)) if block_bytes % s == 0)
        if block_bytes % 2 == 0
        else np.uint8
    )


@pytest.mark.parametrize("block_size", [5, 2])
def test_checksum_py_kernel_path_matches_the_reference_and_the_torch_path(block_size):
    # an fp8_ds_mla byte region (656 bytes a record: int64 words), a bf16 one of 3 values a record
    # (int16 words at 5 tokens a block, int32 at 2) and one of 40 values (int64), one with no blocks
    specs = [KVRegionSpec("latent", 656, record="fp8_ds_mla"), KVRegionSpec("index_k", 3), KVRegionSpec("wide", 40)]
    kv = random_kv(specs, 3, 12, block_size, seed_of("kv", block_size))
    layout = KVLayout.from_kv_cache(kv)
    blocks = {"latent": [3, 4, 9, 1, 0], "index_k": [11, 2, 7], "wide": []}
    want = {}
    for r in layout.regions:
        raw = kv.regions[r.name].view(torch.uint8).reshape(r.num_layers, r.num_blocks, -1).cpu().numpy()
        want[r.name] = reference(raw, word_of(r.block_bytes), blocks[r.name]) if blocks[r.name] else 0
    got = pool_checksums(kv.regions, layout, blocks, kernel=True)
    assert got == want
    assert pool_checksums(kv.regions, layout, blocks, kernel=False) == want
    counts = {k: len(v) for k, v in blocks.items()}
    slab = torch.zeros(slab_parts(layout, counts)[1], dtype=torch.uint8, device=DEVICE)
    gather(kv.regions, layout, blocks, slab)
    assert slab_checksums(slab, layout, counts, kernel=True) == want
    assert slab_checksums(slab, layout, counts, kernel=False) == want
    # per block: each block's own terms, summing to the region's checksum (kernel, torch, slab alike),
    # and a suffix of them is the checksum of those blocks at their positions (pool_checksums' first)
    for kernel in (True, False):
        per = pool_block_checksums(kv.regions, layout, blocks, kernel=kernel)
        assert totals(per) == want and [len(per[k]) for k in blocks] == [5, 3, 0]
        assert slab_block_checksums(slab, layout, counts, kernel=kernel) == per
        tail = pool_checksums(kv.regions, layout, {"latent": blocks["latent"][2:]}, kernel, first={"latent": 2})
        assert tail["latent"] == totals({"latent": per["latent"][2:]})["latent"]
    kv.regions["index_k"][2, 7].view(-1).view(torch.uint8)[1] ^= 0x10  # a flip in one region's request
    flipped = pool_checksums(kv.regions, layout, blocks, kernel=True)
    assert [name for name in want if flipped[name] != want[name]] == ["index_k"]
