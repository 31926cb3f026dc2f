"""Verified KV hand-off (pdserve/disagg/checksum.py): the checksums catch a flipped byte and swapped
blocks; through the fake connector a pool corrupted after the lease fails every read at VERIFY, a
read corrupted once is read again and lands whole, verification off checks nothing; through two
DeepSeek-V4 engines, recompute gives the colocated tokens and fail names the stage. (Real NIXL
between two processes: tests/unit/test_transfer.py, test_nixl_flipped_byte_...)
"""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.base import TransferStage
from pdserve.disagg.checksum import mismatched, pool_checksums, slab_checksums
from pdserve.disagg.factory import StagingOptions
from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.disagg.layout import KVLayout
from pdserve.disagg.staging import gather, slab_parts
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.tiny_model import make_tiny_model
from tests.helpers.transfer_peer import make_kv
from tests.helpers.v4 import NEW_TOKENS, engine, greedy, requests, run
from tests.unit.test_transfer import assert_blocks_equal, run_load

pytestmark = pytest.mark.timeout(120)


def flip(kv, region: str, block: int, byte: int = 0, layer: int = 0) -> None:
    kv.regions[region][layer, block].view(-1).view(torch.uint8)[byte] ^= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_catch_every_flipped_byte_and_swapped_blocks(dtype):
    kv = make_kv(dtype, 0, 16)
    layout = KVLayout.from_kv_cache(kv)
    blocks = {"latent": [3, 4, 9], "index_k": [3, 4, 9]}
    base = pool_checksums(kv.regions, layout, blocks)
    assert base == pool_checksums(kv.regions, layout, blocks)  # deterministic
    g = torch.Generator().manual_seed(0)
    block_bytes = kv.regions["latent"][0, 0].numel() * kv.regions["latent"].element_size()
    for _ in range(40):  # a flip anywhere in the request's bytes: any layer, block, byte, bit
        layer, b = int(torch.randint(3, (1,), generator=g)), blocks["latent"][int(torch.randint(3, (1,), generator=g))]
        byte, bit = int(torch.randint(block_bytes, (1,), generator=g)), int(torch.randint(8, (1,), generator=g))
        raw = kv.regions["latent"][layer, b].view(-1).view(torch.uint8)
        raw[byte] ^= 1 << bit
        assert mismatched(base, pool_checksums(kv.regions, layout, blocks)) == ["latent"]
        raw[byte] ^= 1 << bit
    assert pool_checksums(kv.regions, layout, blocks) == base
    swapped = {"latent": [4, 3, 9], "index_k": [3, 4, 9]}  # two blocks read into each other's place
    assert mismatched(base, pool_checksums(kv.regions, layout, swapped)) == ["latent"]
    other_layer = kv.regions["index_k"].clone()
    kv.regions["index_k"][[0, 1]] = other_layer[[1, 0]]  # layers swapped
    assert mismatched(base, pool_checksums(kv.regions, layout, blocks)) == ["index_k"]


def test_slab_checksums_equal_the_pools():
    kv = make_kv(torch.bfloat16, 2, 16)
    layout = KVLayout.from_kv_cache(kv)
    blocks = {"latent": [1, 7, 2], "index_k": [5]}
    counts = {k: len(v) for k, v in blocks.items()}
    slab = torch.zeros(slab_parts(layout, counts)[1], dtype=torch.uint8)
    gather(kv.regions, layout, blocks, slab)
    assert slab_checksums(slab, layout, counts) == pool_checksums(kv.regions, layout, blocks)


def fake_pair(verify: bool = True, staging: StagingOptions | None = None):
    fabric = FakeFabric()
    pre = FakeConnector("pre", model_id="tiny", fabric=fabric, lease_margin_s=0.0, verify=verify, staging=staging)
    dec = FakeConnector("dec", model_id="tiny", fabric=fabric, verify=verify, staging=staging)
    pre.register_kv_cache(make_kv(torch.float32, 0, 16))
    dec.register_kv_cache(make_kv(torch.float32, 1, 20))
    return pre, dec


def test_fake_flipped_byte_after_the_lease_fails_every_read_at_verify():
    pre, dec = fake_pair()
    handle = pre.on_prefill_finished("r", [3, 4, 9], num_tokens=11)
    flip(pre.kv, "latent", 9, byte=5, layer=2)
    err = run_load(dec, handle, [0, 1, 2])
    assert err is not None and err.stage is TransferStage.VERIFY
    assert "latent" in err.reason and "read twice" in err.reason and "pre" in err.reason
    assert dec.stats.verify_failures == 2 and dec.stats.verified_loads == 0 and dec.stats.transfers_done == 0
    assert dec.stats.failures_by_stage == {"VERIFY": 1}
    assert pre.poll_releases() == ["r"] and dec._plans == {}  # prefill may free its blocks now


@pytest.mark.parametrize("staged", [False, True])
def test_fake_read_corrupted_once_is_read_again_and_lands_whole(staged):
    staging = StagingOptions(mode="on", prefill_arena_mib=1, decode_arena_mib=1) if staged else None
    pre, dec = fake_pair(staging=staging)
    handle = pre.on_prefill_finished("r", [3, 4, 9], num_tokens=11)
    assert (handle.staged is not None) == staged
    dec.corrupt_reads = 1
    dec.start_load(handle, [0, 1, 2])
    assert dec.poll_loads() == ([], [])  # the first read did not check: posted again
    assert pre.poll_releases() == []  # prefill still holds the blocks for the re-read
    assert dec.poll_loads() == (["r"], [])
    assert_blocks_equal(dec.kv, [0, 1, 2], pre.kv, [3, 4, 9])
    assert dec.stats.verify_failures == 1 and dec.stats.verified_loads == 1 and dec.stats.transfers_done == 1
    assert pre.poll_releases() == ["r"]
    if staged:
        assert dec.landing_arena.used_bytes == 0


def test_verification_off_checks_nothing():
    pre, dec = fake_pair(verify=False)
    handle = pre.on_prefill_finished("r", [3], num_tokens=4)
    assert handle.checksums is None
    flip(pre.kv, "latent", 3)
    assert run_load(dec, handle, [0]) is None  # what was read is what the pool held
    assert dec.stats.verified_loads == 0 and dec.stats.verify_failures == 0
    fabric = FakeFabric()  # a verifying decode side reads a handle without checksums unchecked
    off = FakeConnector("off", model_id="tiny", fabric=fabric, lease_margin_s=0.0, verify=False)
    on = FakeConnector("on", model_id="tiny", fabric=fabric)
    off.register_kv_cache(make_kv(torch.float32, 0, 16))
    on.register_kv_cache(make_kv(torch.float32, 1, 20))
    assert run_load(on, off.on_prefill_finished("s", [2], num_tokens=4), [1]) is None
    assert on.stats.verified_loads == 0 and on.stats.transfers_done == 1


# ---------------------------------------------------------------- two engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v4_verify"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(6)
    return [torch.randint(4, 800, (n,), generator=g).tolist() for n in (9, 17, 33)]


def corrupted_hand_off(tiny, prompts, policy: str):
    """Prefill every prompt, flip a byte of each request's first held block (after the lease), decode."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill = engine(tiny, conns[0])
    cfg = EngineConfig(model=str(tiny), dtype="float32", kv_block_size=8, num_kv_blocks=256, skip_tokenizer_init=True)
    decode = LLMEngine(cfg, conns[1], kv_load_failure_policy=policy)
    firsts = run(prefill, requests(prompts, hold_kv=True))
    for out in firsts.values():
        flip(conns[0].kv, "hca_kv", out.kv_handle.block_ids[0], byte=3)
    handoff = [
        Request(request_id=str(i), prompt_token_ids=p, params=greedy(NEW_TOKENS[i]), kv_handle=out.kv_handle,
                first_token=FirstToken(token_id=out.outputs[0].token_ids[0]))
        for i, (p, out) in enumerate((p, firsts[str(i)]) for i, p in enumerate(prompts))
    ]  # fmt: skip
    final = run(decode, handoff)
    prefill.step()  # takes the release notifications
    assert prefill.get_stats().kv_blocks_used == 0 and decode.get_stats().kv_blocks_used == 0
    return final, decode, conns[1]


def test_engine_recompute_after_a_verify_failure_gives_the_colocated_tokens(tiny, prompts):
    colocated = run(engine(tiny), requests(prompts))
    final, decode, conn = corrupted_hand_off(tiny, prompts, "recompute")
    for i in range(len(prompts)):
        assert final[str(i)].outputs[0].token_ids == colocated[str(i)].outputs[0].token_ids
    assert conn.stats.failures_by_stage == {"VERIFY": len(prompts)}
    assert conn.stats.verify_failures == 2 * len(prompts) and decode.remote_kv.num_kv_load_recomputes == len(prompts)


def test_engine_fail_policy_names_the_verify_stage(tiny, prompts):
    final, _, _ = corrupted_hand_off(tiny, prompts[:1], "fail")
    out = final["0"]
    assert out.outputs[0].finish_reason == "error" and "failed at VERIFY" in out.error
    assert out.transfer_error is not None and out.transfer_error.stage == "VERIFY"


def test_verify_counters_reach_the_workers_metrics():
    from prometheus_client import generate_latest

    from pdserve.worker.metrics import WorkerMetrics

    pre, dec = fake_pair()
    dec.corrupt_reads = 1
    assert run_load(dec, pre.on_prefill_finished("r", [1], num_tokens=4), [0]) is None
    metrics = WorkerMetrics()
    metrics.sync_transfer(dec.stats)
    metrics.sync_transfer(dec.stats)  # counted once
    text = generate_latest(metrics.registry).decode()
    assert "pdserve_kv_verified_loads_total 1.0" in text and "pdserve_kv_verify_failures_total 1.0" in text
