"""Staged KV transfer (pdserve/disagg/staging.py) through the fake connector: the slab path moves
exactly the bytes the per-block path moves, for V3, V3.2 (FP8 records too) and V4 pools (window
and state spaces); full arenas fall back to per-block reads; slabs are freed on every path.
Real NIXL (two processes) is in tests/unit/test_transfer.py.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from pdserve.config import TransferConfig
from pdserve.disagg.base import TransferStage
from pdserve.disagg.factory import ConnectorSettings, StagingOptions
from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.disagg.layout import KVLayout, region_blocks
from pdserve.disagg.staging import SLAB_ALIGN, ArenaAllocator, gather, scatter, slab_parts
from pdserve.model.kv_cache import PER_SEQUENCE, KVCache, KVRegionSpec
from pdserve.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(60)

BS = 4  # tokens per block
POOLS = {  # name -> (specs, layers, dtype, window blocks, state slots)
    "v3": ([KVRegionSpec("latent", 36)], 3, torch.bfloat16, 0, 0),
    "v32": ([KVRegionSpec("latent", 36), KVRegionSpec("index_k", 12)], 3, torch.float32, 0, 0),
    "v32_fp8": (
        [KVRegionSpec("latent", 41, record="fp8_ds_mla"), KVRegionSpec("index_k", 12)],
        2,
        torch.bfloat16,
        0,
        0,
    ),
    "v4": (
        [
            KVRegionSpec("window", 20, last_tokens=6),
            KVRegionSpec("csa_kv", 20, (1, 2), 2),
            KVRegionSpec("csa_state", 28, (1, 2), PER_SEQUENCE),
            KVRegionSpec("hca_kv", 20, (0,), 8),
        ],
        3,
        torch.float32,
        9,
        3,
    ),
}


def make_pool(kind: str, num_blocks: int, seed: int) -> KVCache:
    specs, layers, dtype, win, state = POOLS[kind]
    kv = KVCache(specs, layers, num_blocks, BS, dtype, "cpu", num_window_blocks=win, num_state_slots=state)
    gen = torch.Generator().manual_seed(seed)
    for t in kv.regions.values():  # random bit patterns: the comparisons are on bytes
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    return kv


def pair(kind: str, prefill_mib: float = 1, decode_mib: float = 1, staged: bool = True, **kw):
    """A prefill and a decode fake connector over seeded pools; arena sizes in MiB (0: no arena)."""
    fabric = FakeFabric()
    pre_opts = StagingOptions(mode="on" if staged else "off", prefill_arena_mib=int(prefill_mib), decode_arena_mib=0)
    dec_opts = StagingOptions(mode="on" if staged else "off", prefill_arena_mib=0, decode_arena_mib=int(decode_mib))
    pre = FakeConnector("pre", model_id="m", fabric=fabric, lease_margin_s=0.0, role="prefill", staging=pre_opts, **kw)
    dec = FakeConnector(
        "dec",
        model_id="m",
        fabric=fabric,
        role="decode",
        staging=dec_opts,
        lease_margin_s=0.0,
        transfer_timeout_s=kw.get("transfer_timeout_s", 30.0),
    )
    pre.register_kv_cache(make_pool(kind, 24, seed=1))
    dec.register_kv_cache(make_pool(kind, 30, seed=2))
    return pre, dec


# a request of 5 blocks (18 tokens), scattered on both sides; V4 pools add window blocks and a state slot
SRC, DST, TOKENS = [7, 2, 3, 19, 11], [0, 21, 22, 5, 29], 18
SRC_WIN, DST_WIN = [-1, -1, 4, 0, 8], [-1, -1, 8, 7, 1]  # the window (6 tokens) needs blocks 3 and 4 only


def hand_off(pre: FakeConnector, dec: FakeConnector, rid: str, kind: str):
    v4 = kind == "v4"
    handle = pre.on_prefill_finished(
        rid, SRC, TOKENS, window_block_ids=SRC_WIN if v4 else None, state_slot=2 if v4 else -1
    )
    dec.start_load(handle, DST, local_window_block_ids=DST_WIN if v4 else None, local_state_slot=1 if v4 else -1)
    return handle


def finish(dec: FakeConnector, rid: str) -> None:
    done, failed = dec.poll_loads()
    assert done == [rid] and failed == []


def as_bytes(kv: KVCache) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.uint8).clone() for n, t in kv.regions.items()}


def test_arena_allocator_first_fit_coalesces_and_refuses_when_full():
    a = ArenaAllocator(4 * SLAB_ALIGN)
    x, y, z = a.alloc(1), a.alloc(SLAB_ALIGN + 1), a.alloc(SLAB_ALIGN)
    assert (x, y, z) == (0, SLAB_ALIGN, 3 * SLAB_ALIGN) and a.used_bytes == 4 * SLAB_ALIGN
    assert a.alloc(1) is None
    a.free(x)
    a.free(z)
    assert a.alloc(2 * SLAB_ALIGN) is None  # two free ranges of one unit each, not adjacent
    a.free(y)
    assert a.used_bytes == 0 and a.num_slabs == 0 and a.alloc(4 * SLAB_ALIGN) == 0
    assert ArenaAllocator(0).alloc(1) is None


@pytest.mark.parametrize("kind", list(POOLS))
def test_gather_then_scatter_is_the_per_block_copy(kind):
    src, dst = make_pool(kind, 24, seed=3), make_pool(kind, 30, seed=4)
    layout = KVLayout.from_kv_cache(src)
    v4 = kind == "v4"
    s = region_blocks(layout, SRC, TOKENS, SRC_WIN if v4 else None, 2 if v4 else -1)
    d = region_blocks(layout, DST, TOKENS, DST_WIN if v4 else None, 1 if v4 else -1, "decode")
    parts, nbytes = slab_parts(layout, {k: len(v) for k, v in s.items()})
    slab = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # poisoned: every byte the scatter reads is gathered
    gather(src.regions, layout, s, slab)
    want = {n: t.clone() for n, t in dst.regions.items()}
    for name, t in want.items():
        t[:, d[name]] = src.regions[name][:, s[name]]
    scatter(slab, layout, d, dst.regions)
    for name in want:
        assert torch.equal(dst.regions[name].view(torch.uint8), want[name].view(torch.uint8)), name
    assert all(p.offset % SLAB_ALIGN == 0 for p in parts)
    if v4:
        assert s["window"] == [0, 8] and s["csa_state"] == [2] and len(s["hca_kv"]) == 5


@pytest.mark.parametrize("kind", list(POOLS))
def test_staged_hand_off_moves_the_same_bytes_as_per_block(kind):
    results = {}
    for staged in (True, False):
        pre, dec = pair(kind, staged=staged)
        handle = hand_off(pre, dec, "r", kind)
        assert (handle.staged is not None) == staged
        finish(dec, "r")
        results[staged] = (as_bytes(dec.kv), dec.stats.bytes_transferred, dec.stats.descriptors_sum)
        assert pre.poll_releases() == ["r"]
        if staged:
            assert pre.staging_arena.used_bytes == 0 and dec.landing_arena.used_bytes == 0
            assert pre.stats.staged == {("prefill", "staged"): 1} and dec.stats.staged == {("decode", "staged"): 1}
    (kv_s, bytes_s, descs_s), (kv_b, bytes_b, descs_b) = results[True], results[False]
    for name in kv_s:
        assert torch.equal(kv_s[name], kv_b[name]), name
    assert bytes_s == bytes_b and descs_s == 1 and descs_b > 1
    assert bytes_b == sum(KVLayout.from_kv_cache(make_pool(kind, 1, 0)).request_bytes(TOKENS).values())


def test_full_arenas_fall_back_to_per_block_reads():
    # the prefill arena holds one request: the second is not staged and is read block by block
    pre, dec = pair("v32", prefill_mib=1)
    big = pre.staging_arena.capacity
    blocker = pre.staging_arena.alloc(big - SLAB_ALIGN)  # leave less than one slab
    handle = hand_off(pre, dec, "a", "v32")
    assert handle.staged is None and pre.stats.staged == {("prefill", "arena_full"): 1}
    finish(dec, "a")
    assert dec.stats.staged == {("decode", "not_staged"): 1} and dec.stats.descriptors_sum > 1
    pre.staging_arena.free(blocker)
    assert pre.poll_releases() == ["a"]
    ref = as_bytes(dec.kv)
    # the decode landing arena is full: the staged slab is left, the pinned blocks are read instead
    pre2, dec2 = pair("v32")
    blocker = dec2.landing_arena.alloc(dec2.landing_arena.capacity - SLAB_ALIGN)
    handle = hand_off(pre2, dec2, "a", "v32")
    assert handle.staged is not None
    finish(dec2, "a")
    assert dec2.stats.staged == {("decode", "arena_full"): 1}
    assert all(torch.equal(ref[n], t) for n, t in as_bytes(dec2.kv).items())
    dec2.landing_arena.free(blocker)
    assert pre2.poll_releases() == ["a"] and pre2.staging_arena.used_bytes == 0 and dec2.landing_arena.used_bytes == 0


def test_slabs_are_freed_on_abort_failure_cancel_and_expiry():
    pre, dec = pair("v4", lease_s=0.2)
    # abort before decode read it: the engine releases the lease
    hand_off(pre, dec, "abort", "v4")
    pre.release("abort")
    dec.cancel_load("abort")
    assert pre.staging_arena.used_bytes == 0 and dec.landing_arena.used_bytes == 0
    # a read that fails: the landing room is freed, prefill told to free its slab
    dec.fail_next(TransferStage.READING, "wire cut")
    hand_off(pre, dec, "fail", "v4")
    done, failed = dec.poll_loads()
    assert done == [] and failed[0].reason == "wire cut" and dec.landing_arena.used_bytes == 0
    assert pre.poll_releases() == ["fail"] and pre.staging_arena.used_bytes == 0
    # a read that never completes: timeout
    dec.hold_loads, dec.transfer_timeout_s = True, 0.05
    handle = pre.on_prefill_finished("slow", SRC, TOKENS, window_block_ids=SRC_WIN, state_slot=2)
    dec.start_load(handle, DST, local_window_block_ids=DST_WIN, local_state_slot=1)
    time.sleep(0.06)
    done, failed = dec.poll_loads()
    assert done == [] and failed[0].stage is TransferStage.READING and dec.landing_arena.used_bytes == 0
    pre.poll_releases()
    # never read at all: the lease expires and takes the slab with it
    pre.on_prefill_finished("expire", SRC, TOKENS, window_block_ids=SRC_WIN, state_slot=2)
    assert pre.staging_arena.used_bytes > 0
    time.sleep(0.25)
    assert pre.poll_releases() == ["expire"] and pre.staging_arena.used_bytes == 0
    assert pre.stats.lease_expirations == 1


def test_staging_options_are_validated_and_reach_the_connector():
    cfg = TransferConfig.model_validate({"staging": {"mode": "on", "prefill_arena_mib": 64, "decode_arena_mib": 32}})
    settings = ConnectorSettings(model_id="m", role="decode", staging=cfg.staging)
    assert settings.staging.decode_arena_mib == 32 and settings.staging.enabled(on_gpu=False)
    assert not StagingOptions().enabled(on_gpu=False) and StagingOptions().enabled(on_gpu=True)
    for bad in ({"mode": "sometimes"}, {"prefill_arena_mib": -1}, {"arena_mib": 8}):
        with pytest.raises(ValueError):
            TransferConfig.model_validate({"staging": bad})
    # a decode connector makes the landing arena only, a prefill one the staging arena only
    _, dec = pair("v3", prefill_mib=2, decode_mib=3)
    assert dec.staging_arena is None and dec.landing_arena.capacity == 3 << 20


def test_staged_counts_are_exported_as_metrics():
    pre, dec = pair("v3")
    hand_off(pre, dec, "r", "v3")
    finish(dec, "r")
    m = WorkerMetrics()
    m.sync_transfer(dec.stats)
    m.sync_transfer(dec.stats)  # exported once
    value = m.registry.get_sample_value("pdserve_kv_transfer_staged_total", {"side": "decode", "result": "staged"})
    assert value == 1.0


def test_serve_flag_sets_the_staging_mode():
    import argparse

    from pdserve.serve import add_serve_args, config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    base = ["--role", "decode", "--model", "tiny:deepseek_v3", "--peer", "http://127.0.0.1:1"]
    assert config_from_args(p.parse_args(base + ["--kv-transfer-staging", "off"])).transfer.staging.mode == "off"
    assert config_from_args(p.parse_args(base)).transfer.staging.mode == "auto"
    with pytest.raises(Exception, match="staging"):
        config_from_args(p.parse_args(base + ["--kv-transfer-staging", "sometimes"]))


def test_a_failed_scatter_fails_the_request_and_frees_both_slabs(monkeypatch):
    pre, dec = pair("v32")
    hand_off(pre, dec, "r", "v32")

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("pdserve.disagg.leasing_connector.scatter", broken)
    done, failed = dec.poll_loads()
    assert done == [] and failed[0].stage is TransferStage.READING and "scattering the slab" in failed[0].reason
    assert dec.landing_arena.used_bytes == 0 and dec.stats.transfers_failed == 1
    assert pre.poll_releases() == ["r"] and pre.staging_arena.used_bytes == 0


def test_a_gpu_worker_keeps_its_arena_out_of_the_kv_pool_budget():
    from pdserve.serve import add_serve_args, config_from_args
    from pdserve.worker.build import arena_mib

    p = argparse.ArgumentParser()
    add_serve_args(p)
    decode = ["--role", "decode", "--model", "tiny:deepseek_v3", "--peer", "http://127.0.0.1:1"]
    prefill = ["--role", "prefill", "--model", "tiny:deepseek_v3"]
    assert arena_mib(config_from_args(p.parse_args(decode + ["--device", "cuda"]))) == StagingOptions().decode_arena_mib
    assert (
        arena_mib(config_from_args(p.parse_args(prefill + ["--device", "cuda:0"])))
        == StagingOptions().prefill_arena_mib
    )
    assert arena_mib(config_from_args(p.parse_args(decode + ["--device", "cuda", "--kv-transfer-staging", "off"]))) == 0
    assert arena_mib(config_from_args(p.parse_args(decode))) == 0  # CPU pool: staging is off under auto
