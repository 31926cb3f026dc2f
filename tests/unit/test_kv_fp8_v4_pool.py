"""DeepSeek-V4's "fp8_ds_v4" records in the paged pool: regions of pages, the model-side wrappers
(pdserve.model.ops), the KV layout and the compat hash (pools of different records refuse each
other). The kernel itself: test_kernels_kv_fp8_v4.py."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from pdserve.disagg.base import TransferError, TransferStage
from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.disagg.layout import KVLayout, KVRegionLayout, compat_hash
from pdserve.model import ops
from pdserve.model.kv_cache import KVCache, KVRegionSpec
from pdserve_kernels import kv_fp8, ref

D, ROPE, BS = 512, 64, 8
REC = ops.fp8_v4_record_bytes(D, ROPE)


def v4_pool(record: str = "fp8_ds_v4", dim: int = REC, num_blocks: int = 6) -> KVCache:
    """A window region (window space) and a rate-4 entries region on layers 1 and 2 (token space)."""
    specs = [
        KVRegionSpec("window", dim, last_tokens=2 * BS, record=record),
        KVRegionSpec("csa_kv", dim, (1, 2), 4, record=record),
    ]
    return KVCache(specs, 3, num_blocks, BS, torch.bfloat16, "cpu", num_window_blocks=4)


def test_regions_hold_584_byte_records_by_pages():
    assert REC == 584
    kv = v4_pool()
    assert kv.layer_pages("window", 0).shape == (4, BS, 584) and kv.layer_pages("csa_kv", 2).shape == (6, 2, 584)
    assert kv.regions["csa_kv"].dtype == torch.uint8
    assert KVCache.bytes_per_block(list(kv.specs.values()), 3, BS, torch.bfloat16) == 2 * 2 * 584
    with pytest.raises(ValueError, match="layer_pages"):
        kv.layer("window", 0)  # rows of the flat view are not tokens in a page format
    region = {r.name: r for r in KVLayout.from_kv_cache(kv).regions}["csa_kv"]
    assert (region.record, region.record_bytes, region.dtype, region.block_bytes) == (
        "fp8_ds_v4",
        584,
        "uint8",
        2 * 584,
    )


def test_store_then_decode_through_ops_matches_the_reference():
    """Entries written at the slots KVCache.slots gives (ops.store_kv_fp8_v4), read back by
    ops.sparse_mla_decode_fp8_v4 (the torch path here) = the reference over the dequantized keys."""
    gen = torch.Generator().manual_seed(1)
    kv = v4_pool()
    table = torch.tensor([5, 0, 3], dtype=torch.int64)  # 3 blocks of 8 tokens: entries 0..5
    slots = kv.slots("csa_kv", table, 0, 6)
    assert slots.tolist() == [10, 11, 0, 1, 6, 7]
    entries = torch.randn(6, D, generator=gen)
    pages = kv.layer_pages("csa_kv", 1)
    ops.store_kv_fp8_v4(pages, slots, entries, ROPE)
    assert not kv.layer_pages("csa_kv", 2).any()  # the other layer untouched
    keys = kv_fp8.unpack_kv_fp8_v4(pages, kv_fp8.V4Record(D, ROPE))[slots]
    assert ((keys - entries).norm() / entries.norm()).item() < 0.04
    q = torch.randn(2, 1, 16, D, generator=gen)
    idx = torch.stack([slots, slots.flip(0)]).to(torch.int32)[:, None]
    idx[1, 0, 2:4] = -1
    sink = torch.randn(16, generator=gen)
    out, lse = ops.sparse_mla_decode_fp8_v4(q, pages, idx, D**-0.5, ROPE, sink=sink)
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_v4_ref(q.double(), pages, idx, D**-0.5, ROPE, sink=sink.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    flat = ops.gather_kv_fp8_v4(pages, torch.cat([slots, slots.flip(0)]), D, ROPE)  # [12, 1, 584] records
    local = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, -1, -1, 10, 11]], dtype=torch.int32)[:, None]
    out2, _ = ops.sparse_mla_decode_fp8_v4(q, flat, local, D**-0.5, ROPE, sink=sink)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # a step's key buffer: pages of 16 (even: 16-byte aligned), the pool's records copied to slots
    # 0..5, the step's new rows quantized into slots 6..8
    new = torch.randn(3, D, generator=gen)
    step = torch.zeros(1, 16, REC, dtype=torch.uint8)
    kv_fp8.copy_kv_fp8_v4(pages, slots, step, torch.arange(6), kv_fp8.V4Record(D, ROPE))
    ops.store_kv_fp8_v4(step, torch.arange(6, 9), new, ROPE)
    keys = torch.cat(
        [
            kv_fp8.unpack_kv_fp8_v4(pages, kv_fp8.V4Record(D, ROPE))[slots],
            kv_fp8.unpack_kv_fp8_v4(ops.pack_kv_fp8_v4(new, ROPE, page=4), kv_fp8.V4Record(D, ROPE))[:3],
        ]
    )
    idx3 = torch.tensor([[0, 2, 6, 7, 8, -1], [8, -1, 1, 3, 5, 6]], dtype=torch.int32)[:, None]
    out3, _ = ops.sparse_mla_decode_fp8_v4(q, step, idx3, D**-0.5, ROPE, sink=sink)
    want3, _ = ref.sparse_mla_decode_ref(q.double(), keys.double(), idx3, D**-0.5, D, sink=sink.double())
    torch.testing.assert_close(out3.double(), want3, rtol=1e-5, atol=1e-5)


def test_compat_hash_refuses_other_records():
    def h(kv: KVCache) -> str:
        return compat_hash("m", torch.bfloat16, KVLayout.from_kv_cache(kv), BS, "0.1.0")

    v4, values, renamed = h(v4_pool()), h(v4_pool("values", D)), h(v4_pool("fp8_ds_mla", REC))
    assert len({v4, values, renamed}) == 3  # same bytes under another record name differ too
    assert h(v4_pool(num_blocks=20)) == v4  # pool sizes may differ


def test_connectors_refuse_a_pool_of_other_records():
    fabric = FakeFabric()
    pre = FakeConnector("pre-0", model_id="v4", fabric=fabric)
    dec = FakeConnector("dec-0", model_id="v4", fabric=fabric)
    pre.register_kv_cache(v4_pool())
    dec.register_kv_cache(v4_pool("values", D))
    handle = pre.on_prefill_finished("r1", [1], 4)
    with pytest.raises(TransferError) as err:
        dec.start_load(handle, [0])
    assert err.value.stage is TransferStage.HANDSHAKE


def test_unknown_record_formats_are_rejected():
    with pytest.raises(ValueError, match="unknown record format"):
        KVRegionSpec("window", 584, record="fp8_e5m2")
    region = KVLayout.from_kv_cache(v4_pool()).regions[0].model_dump()
    with pytest.raises(ValidationError, match="unknown KV record format"):
        KVRegionLayout(**{**region, "record": "fp8_v5"})
