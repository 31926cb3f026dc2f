"""The prefix cache: the hash chain, the pool's reference counts and LRU eviction, and the engine's
blocks with cached blocks about (aborts, preemption, PD leases: nothing leaks, nothing a running
sequence or a lease holds is evicted). Engine tests run the FakeModel test double of test_engine.py,
whose tokens change when any record is read from a wrong slot."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from pdserve.engine.prefix_cache import PrefixCache, block_hashes, chain_hash, root_hash
from pdserve.engine.request import Request
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams
from tests.unit.test_engine import (
    CopyConnector,
    FakeModel,
    add,
    greedy,
    make_engine,
    reference_greedy,
    run_all,
)

pytestmark = pytest.mark.timeout(120)

ROOT = root_hash("model", "float32", "auto", 4)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return str(tmp_path)


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams()))


# -- the hash chain --
def test_chain_is_sha256_of_parent_and_little_endian_int64_tokens():
    tokens = [1, 2, 300, 2**40]
    raw = b"".join(t.to_bytes(8, "little") for t in tokens)
    assert chain_hash(ROOT, tokens) == hashlib.sha256(ROOT + raw).digest()


def test_a_block_hash_names_its_whole_prefix_and_the_root():
    a = block_hashes(ROOT, list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(ROOT, list(range(13)), 4) == a  # a partial block has no hash
    b = block_hashes(ROOT, [99] + list(range(1, 12)), 4)
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later hash
    c = block_hashes(ROOT, list(range(8)) + [11, 10, 9, 8], 4)
    assert c[:2] == a[:2] and c[2] != a[2]  # order inside a block counts
    other = root_hash("model", "float32", "fp8", 4)
    assert block_hashes(other, list(range(12)), 4)[0] != a[0]  # so does the KV format


def test_sequence_hashes_extend_incrementally():
    seq = seq_of(list(range(10)))
    cache = PrefixCache(8, 4, ROOT)
    assert cache.hashes(seq, 1) == block_hashes(ROOT, list(range(4)), 4)
    seq.append_token(10)
    seq.append_token(11)
    assert cache.hashes(seq, 3) == block_hashes(ROOT, list(range(12)), 4)


def test_hashing_cost_per_1k_tokens_is_small():
    """sha256 over 64-token blocks: well under a millisecond per 1K tokens on any CPU this runs on."""
    tokens = list(range(32_768))
    t0 = time.perf_counter()
    block_hashes(ROOT, tokens, 64)
    per_1k_ms = (time.perf_counter() - t0) * 1e3 / 32
    assert per_1k_ms < 2.0, f"{per_1k_ms:.3f} ms per 1K tokens"


# -- the pool --
def _filled(cache: PrefixCache, tokens: list[int], rid: str) -> Sequence:
    """A sequence holding fresh blocks for tokens, all computed and registered."""
    seq = seq_of(tokens, rid)
    seq.block_table = [cache.take() for _ in range(-(-len(tokens) // 4))]
    seq.num_computed_tokens = len(tokens)
    cache.register(seq)
    return seq


def _free(cache: PrefixCache, seq: Sequence) -> None:
    for b in reversed(seq.block_table):
        cache.give_back(b, seq.request_id)
    seq.block_table = []


def test_hit_shares_blocks_and_keeps_the_last_token_to_compute():
    cache = PrefixCache(8, 4, ROOT)
    a = _filled(cache, list(range(12)), "a")
    a_blocks = list(a.block_table)
    assert (cache.num_used, cache.num_cached, cache.num_free) == (3, 0, 5)
    b = seq_of(list(range(12)), "b")
    hit = cache.lookup(b)
    assert hit.blocks == a.block_table[:2] and hit.num_tokens == 8 and hit.num_cached_free == 0
    cache.share(b, hit)
    cache.count(b, hit)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8 and (cache.queries, cache.hits) == (12, 8)
    _free(cache, a)  # b still holds two of a's blocks: only a's last is cached-free
    assert (cache.num_used, cache.num_cached) == (2, 1)
    _free(cache, b)
    assert (cache.num_used, cache.num_cached, cache.num_free) == (0, 3, 8)
    with pytest.raises(RuntimeError, match="freed twice"):
        cache.give_back(a_blocks[0], "a")


def test_eviction_takes_free_blocks_first_then_the_least_recently_used():
    cache = PrefixCache(6, 4, ROOT)
    x = _filled(cache, [1] * 8, "x")
    y = _filled(cache, [2] * 8, "y")
    _free(cache, x)
    _free(cache, y)
    assert cache.num_cached == 4
    cache.take(), cache.take()
    assert cache.num_cached == 4  # the never-used blocks went first
    cache.take()  # no free block left: the oldest cached one goes (x's last block: freed first)
    assert cache.num_cached == 3
    assert cache.lookup(seq_of([1] * 8 + [0])).num_tokens == 4  # x's first block is still there
    assert cache.lookup(seq_of([2] * 8 + [0])).num_tokens == 8


def test_a_held_block_is_never_evicted():
    cache = PrefixCache(4, 4, ROOT)
    held = _filled(cache, [5] * 8, "held")  # e.g. under a PD lease: still referenced
    other = _filled(cache, [6] * 8, "other")
    others = list(other.block_table)
    _free(cache, other)
    taken = [cache.take(), cache.take()]
    assert set(taken) == set(others)
    assert cache.num_free == 0 and set(held.block_table).isdisjoint(taken)
    assert cache.lookup(seq_of([5] * 8 + [0])).num_tokens == 8


# -- the engine --
def test_aborts_and_preemption_leak_nothing_and_keep_tokens(model_dir):
    shared = [(3 * j) % 60 + 2 for j in range(18)]
    prompts = [shared + [i + 2] * (3 + i) for i in range(6)]
    engine = make_engine(model_dir, num_kv_blocks=24, max_num_batched_tokens=16)
    add(engine, "warm", prompts[0], greedy(3))
    run_all(engine)
    for i, p in enumerate(prompts):
        add(engine, str(i), p, greedy(12))
    add(engine, "gone", prompts[1], greedy(40))
    for _ in range(3):
        engine.step()
    engine.abort_request("gone")
    final = run_all(engine)
    ref = FakeModel(0)
    for i, p in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_greedy(ref, p, 12), f"prompt {i}"
    assert max(final[str(i)].num_cached_tokens for i in range(len(prompts))) >= 16
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits


def test_pd_lease_on_cached_blocks_survives_pool_pressure(model_dir):
    """Prefill hands off a request whose prompt hit the cache; other requests then need the whole
    pool; the decode side still reads the right KV, and both sides end with nothing used."""
    peers: dict[str, CopyConnector] = {}
    prefill = make_engine(model_dir, CopyConnector("P", peers), num_kv_blocks=20)
    decode = make_engine(model_dir, CopyConnector("D", peers))
    p = [(5 * j) % 60 + 2 for j in range(22)]
    add(prefill, "warm", p[:20], greedy(2))
    run_all(prefill)
    add(prefill, "a", p, greedy(6), hold_kv=True)
    first = run_all(prefill)["a"]
    assert first.num_cached_tokens == 20 and prefill.get_stats().num_held == 1
    others = [[(7 * j + i) % 60 + 2 for j in range(40)] for i in range(2)]
    for i, q in enumerate(others):
        add(prefill, f"o{i}", q, greedy(4))
    done = run_all(prefill)
    ref = FakeModel(0)
    for i, q in enumerate(others):
        assert done[f"o{i}"].outputs[0].token_ids == reference_greedy(ref, q, 4)
    add(decode, "a", p, greedy(6), kv_handle=first.kv_handle, first_token=first.outputs[0].token_ids[0])
    final = run_all(decode)
    prefill.step()  # polls the release
    assert final["a"].outputs[0].token_ids == reference_greedy(ref, p, 6)
    assert final["a"].num_cached_tokens is None  # decode loaded its prompt: no lookup there
    assert prefill.get_stats().kv_blocks_used == 0 and decode.get_stats().kv_blocks_used == 0
    assert not prefill.has_held_kv()


def test_disabled_cache_keeps_nothing(model_dir):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    for r in range(2):
        add(engine, str(r), list(range(2, 30)), greedy(3))
        assert run_all(engine)[str(r)].num_cached_tokens is None
    stats = engine.get_stats()
    assert (stats.kv_blocks_cached, stats.prefix_cache_queries) == (0, 0)
