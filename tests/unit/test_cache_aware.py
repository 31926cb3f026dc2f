"""The cache_aware router policy and its prefix tree, without processes: matching, LRU eviction,
the balance rule, a hot prefix that must not starve the other worker, one worker, the settings."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import pytest

from pdserve.config import CacheAwareSettings, RouterConfig
from pdserve.router.policies import CacheAware, make_policy
from pdserve.router.prefix_tree import CHUNK_TOKENS, PrefixTree, chunk_names
from pdserve.serve import add_serve_args, config_from_args

pytestmark = pytest.mark.timeout(60)
C = CHUNK_TOKENS


@dataclass
class W:
    url: str
    in_flight: int = 0


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100_000) for _ in range(n)]


def _policy(**settings) -> tuple[CacheAware, list[tuple[str, int]]]:
    seen: list[tuple[str, int]] = []
    return CacheAware(CacheAwareSettings(**settings), lambda outcome, matched: seen.append((outcome, matched))), seen


# -- the tree --


def test_chunk_names_are_chained_over_the_whole_prefix():
    rng = random.Random(1)
    a = _ids(rng, 3 * C + 5)
    names = chunk_names(a)
    assert len(names) == 3 and len(set(names)) == 3  # the partial 4th chunk is not named
    assert chunk_names(a[: 2 * C]) == names[:2]  # a prefix's names are the prompt's leading names
    b = a.copy()
    b[C + 1] += 1  # differs inside chunk 1: chunk 0 shared, 1 and everything after it not
    other = chunk_names(b)
    assert other[0] == names[0] and not set(other[1:]) & set(names)
    same_chunk_elsewhere = [7] * C + a[C : 2 * C]  # chunk 1's tokens after another chunk 0
    assert chunk_names(same_chunk_elsewhere)[1] != names[1]
    assert chunk_names(a[: C - 1]) == [] and chunk_names([]) == []


def test_match_is_the_longest_held_prefix_in_tokens():
    rng = random.Random(2)
    t = PrefixTree(1000 * C)
    a = _ids(rng, 4 * C)
    t.insert(chunk_names(a))
    assert t.tokens == 4 * C
    assert t.match(chunk_names(a + _ids(rng, 3 * C))) == 4 * C  # a later turn: the whole earlier prompt
    assert t.match(chunk_names(a[: 2 * C] + _ids(rng, 2 * C))) == 2 * C  # diverges in chunk 2
    assert t.match(chunk_names(_ids(rng, 4 * C))) == 0
    t.insert(chunk_names(a[: 2 * C]))  # already held: nothing grows
    assert t.tokens == 4 * C


def test_eviction_keeps_the_bound_and_drops_least_recently_used_leaves_first():
    rng = random.Random(3)
    t = PrefixTree(6 * C)
    old, new = _ids(rng, 4 * C), _ids(rng, 4 * C)
    t.insert(chunk_names(old))
    t.insert(chunk_names(new))
    assert t.tokens == 6 * C  # bounded
    assert t.match(chunk_names(new)) == 4 * C  # the recent prompt whole
    assert t.match(chunk_names(old)) == 2 * C  # the old one lost its last chunks, not its root
    t.insert(chunk_names(old[:C]))  # touching old's root makes it the youngest
    t.insert(chunk_names(_ids(rng, C)))
    assert t.match(chunk_names(old)) == C  # old's chunk 1 (older than new's chunks) went first
    assert t.match(chunk_names(new)) == 4 * C
    long = PrefixTree(2 * C)
    prompt = _ids(rng, 5 * C)  # longer than the whole tree: its prefix is what stays
    long.insert(chunk_names(prompt))
    assert long.tokens == 2 * C and long.match(chunk_names(prompt)) == 2 * C
    with pytest.raises(ValueError, match="at least one chunk"):
        PrefixTree(C - 1)


# -- the policy --


def test_later_turns_follow_the_first_and_new_conversations_spread():
    rng = random.Random(4)
    p, seen = _policy()
    ws = [W("a"), W("b")]
    convs = [_ids(rng, 6 * C) for _ in range(6)]
    first = [p.choose(ws, c).url for c in convs]
    assert first.count("a") == first.count("b") == 3  # cold: the worker with the smallest tree
    for turn in range(4):
        for i, c in enumerate(convs):
            convs[i] = c + _ids(rng, 20) + _ids(rng, 30)  # the answer and the next question appended
            assert p.choose(ws, convs[i]).url == first[i], (turn, i)
    assert [o for o, _ in seen].count("cold") == 6 and [o for o, _ in seen].count("cache") == 24
    assert all(m > 0 for o, m in seen if o == "cache")


def test_cache_threshold_decides_between_the_match_and_the_most_room():
    rng = random.Random(5)
    p, seen = _policy(cache_threshold=0.5)
    ws = [W("a"), W("b")]
    shared = _ids(rng, 4 * C)
    assert p.choose(ws, shared + _ids(rng, 4 * C)).url == "a"
    p.choose(ws, _ids(rng, 2 * C))  # b: the smaller tree
    assert p.choose(ws, shared + _ids(rng, 2 * C)).url == "a"  # 4C of 6C held on a: above 0.5
    assert seen[-1] == ("cache", 4 * C)
    assert p.choose(ws, shared + _ids(rng, 6 * C)).url == "b"  # 4C of 10C: cold, to b's smaller tree
    assert seen[-1] == ("cold", 0)
    short = _ids(rng, C - 1)  # no full chunk: nothing to match, the smaller tree
    assert p.choose(ws, short).url == min(ws, key=lambda w: p.trees[w.url].tokens).url


def test_imbalance_sends_to_the_least_loaded_whatever_it_holds():
    rng = random.Random(6)
    p, seen = _policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    a, b = W("a"), W("b")
    prompt = _ids(rng, 8 * C)
    assert p.choose([a, b], prompt) is a
    a.in_flight, b.in_flight = 5, 1  # gap 4: not over the absolute threshold
    assert p.choose([a, b], prompt) is a and seen[-1][0] == "cache"
    a.in_flight = 6  # gap 5 > 4 and 6 > 2 x 1
    assert p.choose([a, b], prompt) is b and seen[-1] == ("balance", 0)
    a.in_flight, b.in_flight = 30, 20  # gap 10, but 30 < 2 x 20: balanced enough
    c = prompt + _ids(rng, C)
    assert p.choose([a, b], c) in (a, b) and seen[-1][0] == "cache"  # both now hold the prompt: the less loaded
    assert seen[-1][1] == 8 * C and p.choose([a, b], c) is b


def test_a_hot_prefix_does_not_starve_the_other_worker():
    """Every request shares a long system prompt; none finishes. Both workers take requests, and the
    in-flight gap never passes the absolute threshold by more than the request that tips it."""
    rng = random.Random(7)
    p, seen = _policy(balance_abs_threshold=3, balance_rel_threshold=1.5)
    ws = [W("a"), W("b")]
    system = _ids(rng, 16 * C)
    for _ in range(60):
        w = p.choose(ws, system + _ids(rng, C))
        w.in_flight += 1
        assert abs(ws[0].in_flight - ws[1].in_flight) <= 3 + 1
    assert min(w.in_flight for w in ws) >= 25
    assert {"cache", "balance"} <= {o for o, _ in seen}
    # requests finishing on the busy worker (a hot prefix under real load): still both used
    q, _ = _policy(balance_abs_threshold=3, balance_rel_threshold=1.5)
    ws = [W("a"), W("b")]
    picks = []
    for i in range(200):
        w = q.choose(ws, system + _ids(rng, C))
        w.in_flight += 1
        picks.append(w.url)
        if i % 3 == 2:  # each worker finishes one request in three steps
            for x in ws:
                x.in_flight = max(0, x.in_flight - 1)
    assert picks.count("a") >= 60 and picks.count("b") >= 60


def test_one_worker_is_chosen_and_nothing_is_recorded():
    p, seen = _policy()
    only = W("only", in_flight=50)
    assert all(p.choose([only], list(range(i, i + 100))) is only for i in range(5))
    assert p.trees == {} and seen == []
    with pytest.raises(ValueError, match="no worker"):
        p.choose([], [1, 2, 3])


def test_make_policy_and_settings():
    p = make_policy("cache_aware", cache=CacheAwareSettings(cache_threshold=0.7, max_tree_size=64))
    assert isinstance(p, CacheAware) and p.s.cache_threshold == 0.7 and p.name == "cache_aware"
    assert make_policy("cache_aware").s == CacheAwareSettings()
    for bad in ({"cache_threshold": 1.5}, {"balance_rel_threshold": 0.5}, {"max_tree_size": 8}, {"nope": 1}):
        with pytest.raises(ValueError):
            CacheAwareSettings(**bad)


def test_router_flags_reach_the_settings():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    argv = ["--role", "router", "--model", "m", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    argv += ["--prefill-policy", "cache_aware", "--cache-threshold", "0.25", "--balance-abs-threshold", "16"]
    argv += ["--balance-rel-threshold", "2", "--max-tree-size", "4096"]
    cfg = config_from_args(parser.parse_args(argv))
    assert cfg.router.prefill_policy == "cache_aware"
    assert cfg.router.cache_aware == CacheAwareSettings(
        cache_threshold=0.25, balance_abs_threshold=16, balance_rel_threshold=2.0, max_tree_size=4096
    )


def test_cluster_yaml_reaches_the_router_process():
    """router.cache_aware in a cluster YAML: validated with a message naming the key, and carried
    whole into the router's own ServeConfig by launch."""
    from pdserve.config import ConfigError, parse_config
    from pdserve.launch.planning import router_spec

    pd = {"model": "tiny:deepseek_v3", "prefill": [{"port": 30000}, {"port": 30003}], "decode": [{"port": 30001}]}
    router = {"prefill_policy": "cache_aware", "cache_aware": {"cache_threshold": 0.8, "balance_abs_threshold": 2}}
    cfg = parse_config({**pd, "router": router}, "c.yaml")
    spec = router_spec(cfg, "/m", "secret")
    assert spec.config.router.prefill_policy == "cache_aware"
    assert spec.config.router.cache_aware == CacheAwareSettings(cache_threshold=0.8, balance_abs_threshold=2)
    with pytest.raises(ConfigError, match="router.cache_aware.cache_threshold"):
        parse_config({**pd, "router": {"cache_aware": {"cache_threshold": 2}}}, "c.yaml")


# -- auto: prefill's default --


@dataclass
class Info:
    prefix_caching: bool


@dataclass
class Cached(W):
    info: Info | None = None


def test_auto_routes_by_cache_only_where_every_worker_caches():
    """A conversation's later turns go home when both workers keep a prefix cache; round robin
    when one does not, when one's info is not read yet, and nothing is recorded then."""
    rng = random.Random(5)
    first = _ids(rng, 4 * C)
    turns = [first]
    for _ in range(4):  # each turn resends the conversation so far and adds to it
        turns.append(turns[-1] + _ids(rng, C))
    turns = turns[1:]
    seen: list[tuple[str, int]] = []
    policy = make_policy("auto", observe=lambda outcome, matched: seen.append((outcome, matched)))
    assert policy.name == "auto" and RouterConfig().prefill_policy == "auto"
    both = [Cached("a", info=Info(True)), Cached("b", info=Info(True))]
    home = policy.choose(both, first)
    assert [policy.choose(both, t) for t in turns] == [home] * 4
    assert [o for o, _ in seen] == ["cold"] + ["cache"] * 4
    for workers in (
        [Cached("a", info=Info(True)), Cached("b", info=Info(False))],
        [Cached("a", info=Info(True)), Cached("b")],  # b's /internal/info not read yet
    ):
        seen.clear()
        auto = make_policy("auto", observe=lambda outcome, matched: seen.append((outcome, matched)))
        assert [auto.choose(workers, t).url for t in [first, *turns]] == ["a", "b", "a", "b", "a"]
        assert seen == []
    one = [Cached("a", info=Info(True))]
    assert make_policy("auto").choose(one, first) is one[0]


def test_a_worker_says_whether_it_caches_prefixes(tmp_path):
    """WorkerInfo.prefix_caching follows the engine's own block manager: on by default, off by flag,
    and off for a V4 pool whose blocks would split a compressor group (prefix_checkpoints.py)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.tiny_model import make_tiny_model
    from pdserve.worker.build import worker_info

    def info(arch: str, *flags: str) -> bool:
        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        model = make_tiny_model(tmp_path / arch, arch=arch)
        cfg = config_from_args(parser.parse_args(["--role", "colocated", "--model", str(model), *flags]))
        engine = LLMEngine(cfg.worker.engine_config(cfg.model).model_copy(update={"num_kv_blocks": 64}))
        return worker_info(cfg, engine, None).prefix_caching

    assert info("deepseek_v3")
    assert not info("deepseek_v3", "--no-enable-prefix-caching")
    assert info("deepseek_v4", "--kv-block-size", "16")  # the tiny V4's rates: 4 and 16
    assert not info("deepseek_v4", "--kv-block-size", "8")
