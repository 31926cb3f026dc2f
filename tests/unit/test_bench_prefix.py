"""`pdserve bench`'s prefix-cache workloads without a server: the shapes of generated-shared-prefix
and multi-turn prompts, a conversation's turns built from the answers (the request sender replaced
by a recording fake), the cache fields of the report from usage and from worker counters, and the
flag checks."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.bench import dataset, multiturn, report, workers
from pdserve.bench.cli import main
from pdserve.bench.client import RequestOutput

pytestmark = pytest.mark.timeout(60)
VOCAB = dataset.Vocab(5000, frozenset({0, 1, 2}), None)


def test_shared_prefix_groups_really_share_their_system_prompt():
    reqs = dataset.shared_prefix_requests(3, 4, 40, 7, 5, VOCAB, random.Random("s"))
    assert len(reqs) == 12 and all(len(r.prompt) == 47 and r.output_len == 5 for r in reqs)
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt[:40]), []).append(r.prompt[40:])
    assert sorted(map(len, groups.values())) == [4, 4, 4]  # three system prompts, four requests each
    systems = list(groups)
    for a in systems:  # distinct system prompts already differ in their first tokens
        assert all(a[:8] != b[:8] for b in systems if b is not a)
    questions = [tuple(q) for qs in groups.values() for q in qs]
    assert len(set(questions)) == 12  # every request its own question
    order = [systems.index(tuple(r.prompt[:40])) for r in reqs]
    assert order != sorted(order)  # groups interleaved, as users arrive
    assert reqs == dataset.shared_prefix_requests(3, 4, 40, 7, 5, VOCAB, random.Random("s"))  # seeded
    assert not {t for r in reqs for t in r.prompt} & VOCAB.excluded


def test_conversations_shapes():
    convs = dataset.conversations(3, 4, 30, 6, 5, VOCAB, random.Random(1))
    assert len(convs) == 3 and all(c.turns == 4 and len(c.first) == 30 for c in convs)
    assert all(len(c.appended) == 3 and all(len(q) == 6 for q in c.appended) for c in convs)
    assert len({tuple(c.first) for c in convs}) == 3


def _fake_sender(sent: list[list[int]], fail_at: int | None = None, ids: bool = True):
    async def send(client, url, payload, headers, t0):
        sent.append(list(payload["prompt"]))
        n = len(sent)
        out = RequestOutput(success=n != fail_at, error="" if n != fail_at else "HTTP 500: boom")
        out.prompt_tokens, out.output_tokens = len(payload["prompt"]), payload["max_tokens"]
        out.output_ids = [1000 + 10 * n + i for i in range(payload["max_tokens"])] if ids else []
        out.ttft, out.latency = 0.01 * n, 0.02 * n
        return out

    return send


def _run(convs, concurrency=1):
    return asyncio.run(
        multiturn.run_conversations(
            "http://x", "/v1/completions", "m", convs, concurrency, float("inf"), random.Random(0)
        )
    )


def test_each_turn_resends_the_conversation_with_the_answer(monkeypatch):
    sent: list[list[int]] = []
    monkeypatch.setattr(multiturn, "send_request", _fake_sender(sent))
    (conv,) = dataset.conversations(1, 3, 20, 4, 3, VOCAB, random.Random(2))
    outs, _ = _run([conv])
    assert [o.turn for o in outs] == [0, 1, 2] and all(o.success for o in outs)
    assert sent[0] == conv.first
    assert sent[1] == conv.first + outs[0].output_ids + conv.appended[0]
    assert sent[2] == sent[1] + outs[1].output_ids + conv.appended[1]
    assert [len(p) for p in sent] == [20, 27, 34]


def test_a_failed_turn_or_an_answer_without_ids_ends_its_conversation(monkeypatch):
    sent: list[list[int]] = []
    monkeypatch.setattr(multiturn, "send_request", _fake_sender(sent, fail_at=2))
    convs = dataset.conversations(1, 4, 20, 4, 3, VOCAB, random.Random(3))
    outs, _ = _run(convs)
    assert len(sent) == 2 and [o.success for o in outs] == [True, False, False, False]
    assert [o.error for o in outs[2:]] == [multiturn.EARLIER_FAILED] * 2 and [o.turn for o in outs] == [0, 1, 2, 3]
    sent.clear()
    monkeypatch.setattr(multiturn, "send_request", _fake_sender(sent, ids=False))
    outs, _ = _run(convs)
    assert len(sent) == 1 and [o.error for o in outs[1:]] == [multiturn.NO_IDS] * 3
    r = report.level_metrics(outs, 1.0, 1, float("inf"), {})
    assert (r["completed"], r["failed"]) == (1, 3)


def _out(prompt: int, cached: int | None, turn: int = 0, ttft: float = 0.1) -> RequestOutput:
    o = RequestOutput(True, "", 0.0, ttft, [0.01], ttft + 0.01, prompt, 2, True, cached)
    o.turn = turn
    return o


def test_cache_fields_from_usage_and_no_numbers_when_not_reported():
    outs = [_out(100, 0, 0, 0.4), _out(150, 96, 1, 0.1), _out(200, 144, 2, 0.1), RequestOutput(error="x")]
    r = report.level_metrics(outs, 1.0, 1, float("inf"), {})
    assert r["cached_tokens_reported"] and r["total_cached_tokens"] == 240 and r["total_input_tokens"] == 450
    assert r["prefill_tokens_computed"] == 210 and r["prefix_cache_hit_rate"] == pytest.approx(240 / 450)
    assert r["median_ttft_first_turn_ms"] == pytest.approx(400) and r["median_ttft_later_turns_ms"] == pytest.approx(
        100
    )
    assert r["cached_lens"] == [0, 96, 144, None] and r["turns"] == [0, 1, 2, 0]
    silent = report.level_metrics([_out(100, None), _out(100, 50)], 1.0, 1, float("inf"), {})
    assert not silent["cached_tokens_reported"]
    assert silent["total_cached_tokens"] is silent["prefill_tokens_computed"] is silent["prefix_cache_hit_rate"] is None
    assert "median_ttft_first_turn_ms" not in silent  # not a multi-turn level
    table = report.format_cache_table([r, silent])
    assert "hit %" in table and "53.3" in table and "210" in table
    assert table.splitlines()[-1].split()[2:5] == ["-", "-", "-"]  # cached, computed, hit %: not reported


def test_prefix_cache_stats_from_worker_counters():
    q, h = workers.PREFIX_QUERIES, workers.PREFIX_HITS
    before = [{q: 100.0, h: 10.0}, {}, {q: 0.0, h: 0.0}]
    after = [{q: 400.0, h: 250.0, workers.BLOCKS_CACHED: 7.0}, {"pdserve_prompt_tokens_total": 5.0}, {q: 100.0, h: 0.0}]
    s = workers.prefix_cache_stats(["a", "b", "c"], before, after)
    assert (s["queries"], s["hits"], s["computed_tokens"]) == (400, 240, 160)
    assert s["hit_rate"] == pytest.approx(0.6)
    assert [w["url"] for w in s["workers"]] == ["a", "c"]  # b exports no prefix-cache counters
    assert s["workers"][0]["blocks_cached"] == 7.0
    none = workers.prefix_cache_stats(["b"], [{}], [{"pdserve_prompt_tokens_total": 1.0}])
    assert (none["queries"], none["hit_rate"], none["workers"]) == (None, None, [])
    assert none["decode"] == {"kv_bytes_read": 0, "kv_bytes_saved": 0, "saved_fraction": None, "hits": 0}


def test_a_decode_workers_counters_count_apart():
    """A worker whose loads moved KV is a decode worker: its lookups are not prefill computation;
    its bytes read and saved are the level's decode numbers (and the cache table's columns)."""
    q, h, rd, sv = workers.PREFIX_QUERIES, workers.PREFIX_HITS, workers.KV_READ, workers.KV_SAVED
    before = [{q: 0.0, h: 0.0}, {q: 0.0, h: 0.0, rd: 1e6, sv: 0.0}]
    after = [{q: 400.0, h: 240.0}, {q: 400.0, h: 320.0, rd: 2e6, sv: 3e6}]
    s = workers.prefix_cache_stats(["prefill", "decode"], before, after)
    assert (s["queries"], s["hits"], s["computed_tokens"]) == (400, 240, 160)
    assert s["decode"] == {"kv_bytes_read": 1_000_000, "kv_bytes_saved": 3_000_000, "saved_fraction": 0.75, "hits": 320}
    assert [w["loads_kv"] for w in s["workers"]] == [False, True]
    r = report.level_metrics([_out(100, 0, 0, 0.4)], 1.0, 1, float("inf"), {})
    table = report.format_cache_table([{**r, "prefix_cache_workers": s}]).splitlines()
    header = table[0].split("  ")
    row = dict(zip([c.strip() for c in header if c.strip()], table[2].split()))
    assert (row["KV read MB"], row["KV saved %"]) == ("1.0", "75.0")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dataset", "generated-shared-prefix", "--num-prompts", "4"], "drop --num-prompts"),
        (["--dataset", "multi-turn", "--endpoint", "/v1/chat/completions"], "use --endpoint /v1/completions"),
        (["--dataset", "multi-turn", "--num-turns", "0"], "--num-turns must be positive"),
        (["--dataset", "multi-turn", "x.json"], "takes no file"),
        (["--dataset", "loogle"], "unknown dataset 'loogle'"),
        (["--dataset", "generated-shared-prefix", "--gsp-system-prompt-len", "-1"], "--gsp-system-prompt-len"),
    ],
)
def test_flag_checks(extra, message, capsys, tmp_path):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "r.json"), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _level(c: int, ttft: float, later: float, prompt: int, computed: int | None, ids: list[list[int]]) -> dict:
    return {
        "max_concurrency": c, "completed": len(ids), "failed": 0, "median_ttft_ms": ttft,
        "median_ttft_first_turn_ms": ttft * 2, "median_ttft_later_turns_ms": later, "total_input_tokens": prompt,
        "prefill_tokens_computed": computed, "prefix_cache_hit_rate": None if computed is None else 1 - computed / prompt,
        "output_ids": ids, "output_throughput": 10.0,
    }  # fmt: skip


def test_prefix_cache_table_ratios_and_sources(tmp_path, capsys):
    """benchmarks/pd/prefix_cache_table.py: ratios no cache / cache, the goals, answers compared, and
    where each computed count comes from (a no-cache run that reports nothing computed every token)."""
    import json

    from benchmarks.pd import prefix_cache_table as table

    ids = [[1, 2], [3, 4], [5, 6]]
    decode = {"decode": {"kv_bytes_read": 2_500_000, "kv_bytes_saved": 7_500_000, "saved_fraction": 0.75, "hits": 9}}
    files = {
        "pd.json": [{**_level(1, 100.0, 50.0, 9000, 1500, ids), "prefix_cache_workers": decode}],
        "pd-nocache.json": [_level(1, 400.0, 420.0, 9000, None, [[1, 2], [3, 4], [5, 7]])],
        "colocated.json": [_level(1, 100.0, 90.0, 9000, 3000, ids)],
    }
    for name, results in files.items():
        (tmp_path / name).write_text(json.dumps({"results": results}))
    s = table.summarize(str(tmp_path))
    assert s["missing"] == [str(tmp_path / "colocated-nocache.json")]
    (pd,) = s["comparisons"]  # colocated has no run without the cache to compare with
    assert pd["ttft_ratio"] == 4.0 and pd["later_turns_ttft_ratio"] == 8.4 and pd["computed_ratio"] == 6.0
    assert pd["same_answers"] == "2/3" and pd["done"]
    assert [(r["kv_mb_read"], r["kv_saved_pct"]) for r in s["runs"]][:2] == [(2.5, 75.0), (None, None)]
    sources = {(r["deployment"], r["prefix_caching"]): r["computed_from"] for r in s["runs"]}
    assert sources == {
        ("pd", True): "usage",
        ("pd", False): "all prompt tokens (no cache)",
        ("colocated", True): "usage",
    }
    worse = _level(1, 200.0, 90.0, 9000, 3000, ids)  # 2x TTFT, 3x computed: short of the goals
    (tmp_path / "colocated-nocache.json").write_text(
        json.dumps({"results": [{**worse, "prefill_tokens_computed": 9000}]})
    )
    (tmp_path / "colocated.json").write_text(json.dumps({"results": [_level(1, 100.0, 90.0, 9000, None, ids)]}))
    s = table.summarize(str(tmp_path))
    col = s["comparisons"][1]
    assert col["deployment"] == "colocated" and col["computed_ratio"] is None and not col["done"]
    assert [r["computed_from"] for r in s["runs"] if r["deployment"] == "colocated"][0] == "not reported"
    printed = table.format_summary(s)
    assert "no cache / cache:" in printed and "done (>= 3x, >= 5x)" in printed and "not reported" in printed


def test_router_breakdown_reads_the_kv_bytes_saved():
    """The router's saved-bytes counter reaches the breakdown (its "KV saved MB/req" column)."""
    from pdserve.bench import breakdown

    text = "\n".join(
        [
            "# TYPE pdserve_router_pd_handoff_seconds histogram",
            'pdserve_router_pd_handoff_seconds_count{part="kv_transfer"} 2.0',
            'pdserve_router_pd_handoff_seconds_sum{part="kv_transfer"} 0.5',
            "# TYPE pdserve_router_kv_transfer_bytes counter",
            "pdserve_router_kv_transfer_bytes_total 100.0",
            "# TYPE pdserve_router_kv_transfer_bytes_saved counter",
            "pdserve_router_kv_transfer_bytes_saved_total 300.0",
        ]
    )
    b = breakdown.breakdown({}, breakdown.parse(text + "\n"))
    assert (b["kv_transfers"], b["kv_bytes_per_request"], b["kv_bytes_saved_per_request"]) == (2, 50.0, 150.0)
