"""Decode-side prefix caching under PD, in one process through the fake connector (which copies what
the KV layout describes, region by region, as NIXL reads it): a conversation's second turn reads
from the prefill worker only the token blocks the decode worker does not hold from the first turn
(its prompt, loaded, and its answer, decoded there); DeepSeek-V4's window and compressor state are
read whole every time. The staged slab holds every block, so a partial load reads the blocks. The tokens are those of the same decode worker with its cache off (whose
PD path tests/unit/test_v4_pd.py and test_engine.py hold against colocated engines, and those
against transformers); the bytes moved and saved follow from the layout's block sizes.

Tiny models: V3 and V4 (window 8, CSA rate 4, HCA rate 16), blocks of 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.base import TransferStage
from pdserve.disagg.factory import StagingOptions
from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.request import FirstToken, Request
from pdserve.model.kv_cache import TOKENS
from pdserve.tiny_model import make_tiny_model
from pdserve.wire.metrics import render
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.metrics import WorkerMetrics
from tests.helpers.v4 import engine, greedy, run

pytestmark = pytest.mark.timeout(300)

BS, NEW = 16, 6
BOTH = pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
V3 = pytest.mark.parametrize("arch", ["deepseek_v3"])  # block accounting alone: the model does not matter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, object] = {}

    def tiny(arch: str):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}_dpc"), arch=arch, seed=0)
        return made[arch]

    return tiny


@pytest.fixture
def tiny(models, arch):
    return models(arch)


@pytest.fixture(scope="module")
def conversation():
    g = torch.Generator().manual_seed(21)
    return torch.randint(4, 280, (37,), generator=g).tolist(), torch.randint(4, 280, (11,), generator=g).tolist()


def pd_pair(tiny, reuse: bool = True, policy: str = "fail", staging: StagingOptions | None = None, **decode_kw):
    """(prefill engine, decode engine, decode's connector); decode caches only when reuse."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0, staging=staging) for e in ("P", "D")]
    prefill = engine(tiny, conns[0], kv_block_size=BS, kv_role="kv_producer")
    decode_kw = dict(kv_block_size=BS, kv_role="kv_consumer", enable_prefix_caching=reuse, **decode_kw)
    decode = engine(tiny, conns[1], **decode_kw)
    decode.remote_kv.policy = policy
    return prefill, decode, conns[1]


def handoff(prefill, rid: str, prompt: list[int]) -> Request:
    """Prefill prompt (KV held under a lease); the decode request that continues it."""
    first = run(prefill, [Request(request_id=rid, prompt_token_ids=prompt, params=greedy(NEW), hold_kv=True)])[rid]
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=greedy(NEW),
        kv_handle=first.kv_handle,
        first_token=FirstToken(token_id=first.outputs[0].token_ids[0]),
    )


def turn(prefill, decode, rid: str, prompt: list[int]):
    out = run(decode, [handoff(prefill, rid, prompt)])[rid]
    prefill.step()  # takes the release
    return out


def two_turns(prefill, decode, conversation):
    p1, question = conversation
    a = turn(prefill, decode, "t1", p1)
    p2 = p1 + a.outputs[0].token_ids + question
    return a, turn(prefill, decode, "t2", p2), p2


def token_block_bytes(conn) -> int:
    """Bytes one token block of every token-space region moves (all layers)."""
    return sum(r.block_bytes * r.num_layers for r in conn.layout.regions if r.space == TOKENS)


def assert_nothing_used(*engines) -> None:
    for e in engines:
        s = e.get_stats()
        assert (s.kv_blocks_used, s.kv_window_blocks_used, s.kv_state_slots_used) == (0, 0, 0)
        assert not e.has_held_kv() and not e.has_unfinished_requests()


@pytest.fixture(scope="module")
def colds(models, conversation):
    """Per model: the conversation with the decode worker's cache off (its tokens and loads)."""
    known: dict[str, tuple] = {}

    def cold(arch: str):
        if arch not in known:
            prefill, decode, conn = pd_pair(models(arch), reuse=False)
            a, b, _ = two_turns(prefill, decode, conversation)
            known[arch] = a.outputs[0].token_ids, b.outputs[0].token_ids, list(conn.stats.recent_loads)
        return known[arch]

    return cold


@pytest.fixture
def cold(colds, arch):
    return colds(arch)


@BOTH
def test_next_turn_reads_only_the_blocks_decode_lacks(tiny, conversation, cold):
    staging = StagingOptions(mode="on", prefill_arena_mib=4, decode_arena_mib=4)
    prefill, decode, conn = pd_pair(tiny, staging=staging)
    a, b, p2 = two_turns(prefill, decode, conversation)
    assert (a.outputs[0].token_ids, b.outputs[0].token_ids) == cold[:2]
    # turn 1 left decode the full blocks of its prompt and of the answer it computed (all but the
    # last token): the second prompt starts with them
    held = (len(conversation[0]) + NEW - 1) // BS
    k = min(held, len(p2) // BS)
    assert k >= 2
    first, second = conn.stats.recent_loads
    whole = [sum(conn.layout.request_bytes(n).values()) for n in (len(conversation[0]), len(p2))]
    saved = k * token_block_bytes(conn)
    assert (first.nbytes, first.nbytes_saved) == (whole[0], 0)
    assert (second.nbytes, second.nbytes_saved) == (whole[1] - saved, saved)
    assert [r.nbytes for r in cold[2]] == whole  # without the cache every block moves
    assert conn.stats.bytes_saved == saved and conn.stats.bytes_transferred == sum(whole) - saved
    assert conn.stats.verified_loads == 2 and conn.stats.verify_failures == 0  # the partial read, checked
    # turn 1 moved as one slab; turn 2's slab holds every block, so its later blocks are read alone
    assert conn.stats.staged == {("decode", "staged"): 1, ("decode", "partial"): 1}
    assert conn.landing_arena.used_bytes == 0 and prefill.connector.staging_arena.used_bytes == 0
    stats = decode.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (len(conversation[0]) + len(p2), k * BS)
    assert b.num_cached_tokens is None  # usage's cached tokens are the prefill's
    assert_nothing_used(prefill, decode)
    # /metrics (and /health, from the same stats): cached blocks apart from used ones, bytes saved
    async_engine = AsyncEngine(decode, WorkerMetrics())
    async_engine._sync_metrics()  # what the step loop does after each step
    text = render(async_engine.metrics.registry).decode()
    metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(metrics["pdserve_kv_transfer_bytes_saved_total"]) == conn.stats.bytes_saved > 0
    assert float(metrics["pdserve_kv_blocks_used"]) == stats.kv_blocks_used == 0
    assert float(metrics["pdserve_kv_blocks_cached"]) == stats.kv_blocks_cached > 0
    assert float(metrics["pdserve_prefix_cache_hits_total"]) == stats.prefix_cache_hits > 0


@V3
def test_a_corrupted_partial_read_is_read_again(tiny, conversation, cold):
    prefill, decode, conn = pd_pair(tiny)
    p1, question = conversation
    a = turn(prefill, decode, "t1", p1)
    conn.corrupt_reads = 1  # flips a byte of the first block the second turn's load writes
    b = turn(prefill, decode, "t2", p1 + a.outputs[0].token_ids + question)
    assert b.outputs[0].token_ids == cold[1]
    assert (conn.stats.verify_failures, conn.stats.verified_loads) == (1, 2)
    assert_nothing_used(prefill, decode)


@BOTH
def test_aborts_and_failed_loads_leak_nothing(tiny, conversation, cold):
    prefill, decode, conn = pd_pair(tiny)
    p1, question = conversation
    a = turn(prefill, decode, "t1", p1)
    p2 = p1 + a.outputs[0].token_ids + question
    cached = decode.get_stats().kv_blocks_cached
    # aborted while its load is in flight, holding its reused blocks
    conn.hold_loads = True
    decode.add_request(handoff(prefill, "aborted", p2))
    decode.step()
    assert decode.scheduler.loading["aborted"].num_reused_blocks >= 2
    decode.abort_request("aborted")
    decode.step()
    prefill.step()
    conn.hold_loads = False
    assert_nothing_used(prefill, decode)
    assert decode.get_stats().kv_blocks_cached == cached  # the reused blocks are cached again
    # a failed load (policy fail): an error, nothing held; its reused blocks stay cached
    conn.fail_next(TransferStage.READING, "injected")
    failed = turn(prefill, decode, "failed", p2)
    assert failed.outputs[0].finish_reason == "error" and failed.transfer_error.stage == "READING"
    assert_nothing_used(prefill, decode)
    # a failed load recomputed here: the tokens of the cold run
    decode.remote_kv.policy = "recompute"
    conn.fail_next(TransferStage.READING, "injected")
    again = turn(prefill, decode, "recomputed", p2)
    assert again.outputs[0].token_ids == cold[1] and decode.remote_kv.num_kv_load_recomputes == 1
    assert_nothing_used(prefill, decode)


@V3
def test_eviction_on_decode_never_takes_a_held_block(tiny, conversation, cold):
    """A decode pool of 10 blocks: turn 2 shares the blocks turn 1 left cached while another request
    needs more than the free blocks; only cached blocks no sequence holds are evicted."""
    prefill, decode, conn = pd_pair(tiny, num_kv_blocks=10)
    p1, question = conversation
    a = turn(prefill, decode, "t1", p1)
    turn(prefill, decode, "z", [(11 * j) % 270 + 4 for j in range(50)])  # 3 cached blocks to evict
    p2 = p1 + a.outputs[0].token_ids + question  # 54 tokens: 4 blocks, the first 2 cached here
    cache = decode.block_manager.prefix_cache
    assert (cache.num_cached, cache.num_free) == (5, 10)
    decode.add_request(handoff(prefill, "t2", p2))
    decode.add_request(handoff(prefill, "other", [(13 * j) % 270 + 4 for j in range(70)]))  # 5 blocks
    named, done = len(cache._by_hash), {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                done[out.request_id] = out
        for seq in [*decode.scheduler.running, *decode.scheduler.loading.values()]:
            assert all(b in cache._ref for b in seq.block_table), "a block a sequence holds was evicted"
    prefill.step()
    assert cache.hits == 2 * BS  # turn 2's hit (turn 1 and z found nothing)
    # turn 2 named 1 more full block, `other` 4: fewer are named now, as cached blocks were evicted
    assert len(cache._by_hash) < named + 5
    assert done["t2"].outputs[0].token_ids == cold[1] and conn.stats.bytes_saved > 0
    assert_nothing_used(prefill, decode)
