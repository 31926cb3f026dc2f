"""`pdserve bench`: metric arithmetic, prompts, and runs against a real tiny pdserve cluster
(tests/helpers/cluster.py): fields present and consistent with the server's usage, the router's TTFT
breakdown (PD and colocated) and the deployment read from the router, a worker killed mid-run
gives failed counts and a finished report, plots written."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from pdserve.bench import dataset, report, workers
from pdserve.bench.cli import main
from pdserve.bench.client import RequestOutput, _chunk_tokens, build_payload
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.timeout(300)


def _ok(start: float, ttft: float, itl: list[float], prompt: int, out: int) -> RequestOutput:
    latency = ttft + sum(itl)
    return RequestOutput(True, "", start, ttft, itl, latency, prompt, out, True)


def test_level_metrics_arithmetic():
    outputs = [
        _ok(0.0, 0.1, [0.02, 0.02, 0.02], 16, 4),  # TPOT (0.16 - 0.1) / 3 = 20 ms
        _ok(0.05, 0.3, [0.04, 0.04, 0.04], 16, 4),  # TPOT 40 ms, e2el 420 ms
        RequestOutput(error="HTTP 503: no decode worker"),
    ]
    r = report.level_metrics(outputs, duration=2.0, max_concurrency=2, request_rate=float("inf"), slo={"tpot_ms": 30.0})
    assert (r["completed"], r["failed"], r["num_prompts"]) == (2, 1, 3)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (32, 8)
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(20.0)
    assert r["mean_tpot_ms"] == pytest.approx(30.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_itl_ms"] == pytest.approx(30.0)
    assert r["p99_e2el_ms"] == pytest.approx(160 + 0.99 * 260)
    assert r["good_completed"] == 1 and r["request_goodput"] == pytest.approx(0.5)
    assert r["max_concurrent_requests"] == 2
    assert r["request_rate"] == "inf"
    assert r["error_counts"] == {"HTTP 503: no decode worker": 1}
    assert r["errors"] == ["", "", "HTTP 503: no decode worker"]
    none = report.level_metrics([RequestOutput(error="x")], 1.0, 1, 1.0, {})
    assert none["mean_ttft_ms"] is None and none["request_goodput"] is None and none["completed"] == 0
    assert "-" in report.format_table([none])


def test_parse_slo():
    assert report.parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert report.parse_slo(None) == {}
    with pytest.raises(ValueError, match="KEY one of ttft_ms, tpot_ms, e2el_ms"):
        report.parse_slo("ttft=500")
    with pytest.raises(ValueError, match="not a number"):
        report.parse_slo("tpot_ms=fast")


def test_random_prompts_exact_and_seeded(tmp_path):
    vocab = dataset.Vocab(1000, frozenset({0, 1, 2, 3}), None)
    a = dataset.random_requests(5, 16, 8, vocab, random.Random("0:0"))
    b = dataset.random_requests(5, 16, 8, vocab, random.Random("0:0"))
    assert a == b and all(len(r.prompt) == 16 and r.output_len == 8 for r in a)
    assert not {t for r in a for t in r.prompt} & vocab.excluded
    body = build_payload("/v1/completions", "m", a[0])
    assert body["prompt"] == a[0].prompt and body["ignore_eos"] and body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="need /v1/completions"):
        build_payload("/v1/chat/completions", "m", a[0])
    share = tmp_path / "sharegpt.json"
    share.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                {"conversations": []},
            ]
        )
    )
    assert (
        dataset.sharegpt_requests(dataset.load_sharegpt(str(share)), 2, 8, random.Random(0))
        == [dataset.BenchRequest("hi", 8)] * 2
    )


def test_chunk_token_counting():
    assert _chunk_tokens({"text": "ab", "finish_reason": None}) == 1
    assert _chunk_tokens({"text": "", "finish_reason": None}) == 1  # held-back partial UTF-8
    assert _chunk_tokens({"text": "", "finish_reason": "length"}) == 0  # bare finish marker
    assert _chunk_tokens({"text": "abc", "token_ids": [5, 6], "finish_reason": None}) == 2
    assert _chunk_tokens({"delta": {"role": "assistant", "content": ""}}) == 0
    assert _chunk_tokens({"delta": {"content": "x"}}) == 1


def test_unreachable_server_fails_requests_not_the_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    base = [
        "--base-url",
        "http://127.0.0.1:9",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--disable-tqdm",
        "--out",
        str(out),
    ]
    assert main(base + ["--concurrency", "1,2", "--num-prompts", "2"]) == 2
    assert "--concurrency has 2 levels but --num-prompts has 1" in capsys.readouterr().err
    assert main(base) == 2  # no --model and no /v1/models to ask
    assert "pass --model" in capsys.readouterr().err
    assert main(base + ["--model", "m", "--concurrency", "2", "--num-prompts", "3", "--timeout", "5"]) == 1
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert (r["completed"], r["failed"]) == (0, 3)
    assert sum(r["error_counts"].values()) == 3 and all(e.startswith("ConnectError") for e in r["error_counts"])
    assert "3 failed: ConnectError" in capsys.readouterr().out


# ---- against a real tiny PD cluster: prefill + decode workers (NIXL transfer) behind a router ----


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.prefill = c.worker("prefill")
        c.decode = c.worker("decode", peers=[c.prefill])
        c.pd_router = c.router(prefill=[c.prefill], decode=[c.decode])
        c.colocated = c.worker("colocated")
        c.col_router = c.router(colocated=[c.colocated])
        c.wait_healthy()
        yield c


def _scrape(url: str) -> dict[str, float]:
    return workers.parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


VLLM_FIELDS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_concurrency", "request_rate",
    "input_lens", "output_lens", "ttfts", "itls", "errors", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p90", "p99")),
)  # fmt: skip


def test_bench_against_cluster(cluster, tmp_path, capsys):
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    router_before, prefill_before = _scrape(cluster.pd_router.url), _scrape(cluster.prefill.url)
    argv = [
        "--base-url", cluster.pd_router.url, "--input-len", "16", "--output-len", "8",
        "--concurrency", "1,4", "--num-prompts", "2,8", "--slo", "ttft_ms=60000,tpot_ms=60000",
        "--metrics-url", cluster.prefill.url, "--metrics-url", cluster.decode.url,
        "--disable-tqdm", "--out", str(out), "--plot", str(png),
    ]  # fmt: skip
    assert main(argv) == 0
    router_after, prefill_after = _scrape(cluster.pd_router.url), _scrape(cluster.prefill.url)
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and f"wrote {out}" in printed

    doc = json.loads(out.read_text())
    assert set(doc) >= {"results", "config", "date", "server"}
    assert doc["server"]["model"] == "tiny"  # asked /v1/models
    assert doc["config"]["vocab"]["tokenizer"].endswith("tokenizer.json")  # found through the model card's root
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 4]
    for r, sent in zip(doc["results"], (2, 8)):
        assert not [f for f in VLLM_FIELDS if f not in r]
        assert (r["completed"], r["failed"], r["num_prompts"]) == (sent, 0, sent)
        assert r["input_lens"] == [16] * sent and r["output_lens"] == [8] * sent  # from usage, exact
        assert (r["total_input_tokens"], r["total_output_tokens"]) == (16 * sent, 8 * sent)
        assert r["usage_reported"] and r["good_completed"] == sent
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
        assert 0 < r["median_ttft_ms"] <= r["median_e2el_ms"] and r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
        # one gap per token chunk after the first: at most 7; fewer where the server coalesces tokens
        assert all(len(itl) <= 7 for itl in r["itls"]) and sum(map(len, r["itls"])) > 0
        assert 1 <= r["max_concurrent_requests"] <= r["max_concurrency"]
        assert r["worker_metrics"]["decode_steps"] > 0 and r["worker_metrics"]["mean_decode_step_ms"] > 0
    # the server's own counters agree with the report
    completed_200 = sum(v for k, v in router_after.items() if k.startswith("pdserve_router_requests_total"))
    assert (
        completed_200 - sum(v for k, v in router_before.items() if k.startswith("pdserve_router_requests_total")) >= 10
    )
    assert (
        router_after["pdserve_router_prompt_tokens_total"] - router_before["pdserve_router_prompt_tokens_total"]
        == 16 * 10
    )
    assert (
        router_after["pdserve_router_generation_tokens_total"] - router_before["pdserve_router_generation_tokens_total"]
        == 8 * 10
    )
    assert prefill_after["pdserve_prompt_tokens_total"] - prefill_before["pdserve_prompt_tokens_total"] == 16 * 10

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    both = tmp_path / "both.png"
    assert main(["plot", str(out), str(out), "-o", str(both), "--title", "pd twice"]) == 0
    assert both.read_bytes()[:4] == b"\x89PNG" and both.stat().st_size > 10_000


def _bench_one_level(url: str, out) -> dict:
    argv = [
        "--base-url",
        url,
        "--input-len",
        "40",
        "--output-len",
        "6",
        "--concurrency",
        "3",
        "--num-prompts",
        "6",
        "--disable-tqdm",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_ttft_parts(r: dict) -> dict:
    """Parts present, non-negative, and no more than the TTFT they split (router's, client's)."""
    b = r["ttft_breakdown"]
    assert b["requests"] == r["completed"] == 6
    parts = b["ttft_ms"]
    assert set(parts) == {"queue", "prefill", "other"} and all(v is not None and v >= 0 for v in parts.values())
    assert parts["prefill"] > 0  # a 40-token prompt takes a step
    assert sum(parts.values()) <= b["router_mean_ttft_ms"] + 0.5  # the router's span includes the dispatch's
    assert b["router_mean_ttft_ms"] <= r["mean_ttft_ms"] + 0.5  # the client's adds the hop to it
    return b


def test_ttft_breakdown_pd(cluster, tmp_path, capsys):
    decode_before = _scrape(cluster.decode.url)
    doc = _bench_one_level(cluster.pd_router.url, tmp_path / "pd.json")
    decode_after = _scrape(cluster.decode.url)
    assert doc["deployment"]["workers"] == {"prefill": 1, "decode": 1} and doc["deployment"]["gpus"] == 0  # cpu
    (r,) = doc["results"]
    b = _check_ttft_parts(r)
    handoff = b["handoff_ms"]
    assert (
        set(handoff) == {"dispatch", "decode_queue", "kv_transfer", "first_decode", "other"} and handoff["dispatch"] > 0
    )
    assert (
        all(v is not None and v >= 0 for v in handoff.values())
        and handoff["kv_transfer"] > 0
        and handoff["first_decode"] > 0
    )
    # the hand-off ends at decode's first token, before the last: within the client's e2el - ttft
    assert sum(handoff.values()) <= r["mean_e2el_ms"] - r["mean_ttft_ms"] + 5.0
    # bytes per request as the router summed them from the workers' timing = the decode worker's own count
    kv = decode_after["pdserve_kv_transfer_bytes_total"] - decode_before["pdserve_kv_transfer_bytes_total"]
    assert b["kv_transfers"] == 6 and b["kv_bytes_per_request"] == pytest.approx(kv / 6) and kv > 0
    assert b["kv_gb_per_s"] > 0
    assert b["handoffs_via"] == {"prefill": 0, "router": 6}  # this prefill worker has no --peer: the router posts them
    printed = capsys.readouterr().out
    assert "KV GB/s" in printed and "dec queue" in printed


def test_ttft_breakdown_colocated_and_advice(cluster, tmp_path, capsys):
    doc = _bench_one_level(cluster.col_router.url, tmp_path / "col.json")
    assert doc["deployment"]["workers"] == {"colocated": 1}
    (r,) = doc["results"]
    b = _check_ttft_parts(r)
    assert b["handoff_ms"] is None and b["kv_transfers"] == 0 and b["kv_gb_per_s"] is None
    _bench_one_level(cluster.pd_router.url, tmp_path / "pd.json")
    assert main(["advise", str(tmp_path / "col.json"), str(tmp_path / "pd.json")]) == 0
    out = capsys.readouterr().out
    assert "c=3: colocated TTFT" in out and "c=3: PD TTFT" in out and "PD hand-off" in out
    assert "GPUs: colocated 1 (assumed" in out  # a cpu cluster records no GPUs


def test_sharegpt_over_chat_endpoint(cluster, tmp_path):
    share = tmp_path / "sharegpt.json"
    convs = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]}
        for q in ("hello there", "what is a KV cache?", "count to three")
    ]
    share.write_text(json.dumps(convs))
    out = tmp_path / "chat.json"
    argv = [
        "--base-url", cluster.pd_router.url, "--model", "tiny", "--dataset", "sharegpt", str(share),
        "--endpoint", "/v1/chat/completions", "--output-len", "4", "--concurrency", "2", "--num-prompts", "3",
        "--disable-tqdm", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["completed"], r["failed"]) == (3, 0)
    assert r["output_lens"] == [4, 4, 4] and all(n > 3 for n in r["input_lens"])  # chat template tokens included
    assert main(argv[:6] + ["--endpoint", "/v1/chat/completions", "--out", str(out)]) == 2  # sharegpt without its file


def test_decode_killed_mid_run_gives_failures_and_a_report(cluster, tmp_path, capsys):
    """A second decode worker and router on the shared prefill; the decode is SIGKILLed once it has
    finished two requests. The run finishes, counts the failures with their errors, and writes its report."""
    decode = cluster.worker("decode", peers=[cluster.prefill])
    router = cluster.router(prefill=[cluster.prefill], decode=[decode])
    cluster.wait_healthy()
    killed = threading.Event()

    def kill_after_two() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _scrape(decode.url).get("pdserve_request_success_total", 0) >= 2:
                    os.killpg(decode.popen.pid, signal.SIGKILL)  # its own session, started by this test
                    killed.set()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_two)
    killer.start()
    out = tmp_path / "killed.json"
    argv = [
        "--base-url", router.url, "--input-len", "16", "--output-len", "48", "--concurrency", "2",
        "--num-prompts", "16", "--timeout", "30", "--disable-tqdm", "--out", str(out),
    ]  # fmt: skip
    try:
        rc = main(argv)
    finally:
        killer.join()
    assert killed.is_set()
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] + r["failed"] == 16
    assert r["completed"] >= 2 and r["failed"] >= 1 and sum(r["error_counts"].values()) == r["failed"]
    assert all(r["errors"][i] for i, n in enumerate(r["output_lens"]) if n == 0)
    assert r["total_output_tokens"] == 48 * r["completed"]
    assert "failed:" in capsys.readouterr().out


def test_router_benchmark_streams_every_token_through_the_real_router(tmp_path):
    """benchmarks/router/bench_router.py: its fake worker speaks the worker protocol well enough that the
    real router serves every requested token, and the row holds the router's CPU per token."""
    import subprocess
    import sys

    out = tmp_path / "router.json"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.router.bench_router", "--concurrency", "2", "--output-len", "8", "--rounds", "1", "--step-ms", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["concurrency"], row["requests"], row["tokens"]) == (2, 2, 16)
    assert row["completed_tokens"] == 16 and row["router_cpu_us_per_token"] > 0 and row["itl_median_ms"] > 0


def _cache_consistent(r: dict) -> None:
    """The prefix-cache fields: numbers only where the server reported them, and consistent."""
    if r["cached_tokens_reported"]:
        assert 0 <= r["total_cached_tokens"] <= r["total_input_tokens"]
        assert r["prefill_tokens_computed"] == r["total_input_tokens"] - r["total_cached_tokens"]
        assert r["prefix_cache_hit_rate"] == pytest.approx(r["total_cached_tokens"] / r["total_input_tokens"])
        assert sum(r["cached_lens"]) == r["total_cached_tokens"]
    else:
        assert r["total_cached_tokens"] is r["prefill_tokens_computed"] is r["prefix_cache_hit_rate"] is None
    w = r["prefix_cache_workers"]
    if w["queries"] is None:
        assert w["hits"] is w["computed_tokens"] is w["hit_rate"] is None
        assert all(x["loads_kv"] for x in w["workers"])  # only decode workers' counters, if any
    else:
        assert 0 <= w["hits"] <= w["queries"] and w["computed_tokens"] == w["queries"] - w["hits"]


def test_multi_turn_against_cluster(cluster, tmp_path, capsys):
    """Conversations of 3 turns: each later prompt is exactly the last prompt + the answer + a question."""
    out = tmp_path / "mt.json"
    argv = [
        "--base-url", cluster.pd_router.url, "--dataset", "multi-turn", "--num-turns", "3", "--input-len", "24",
        "--question-len", "8", "--output-len", "4", "--concurrency", "2", "--num-prompts", "2",
        "--metrics-url", cluster.prefill.url, "--save-output-ids", "--disable-tqdm", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT 1st turn" in printed and "hit %" in printed
    (r,) = json.loads(out.read_text())["results"]
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    assert r["turns"] == [0, 1, 2, 0, 1, 2]
    assert r["input_lens"] == [24, 36, 48] * 2  # the server's own prompt counts: 24, + 4 answer + 8 question, ...
    assert r["median_ttft_first_turn_ms"] > 0 and r["median_ttft_later_turns_ms"] > 0
    assert [len(ids) for ids in r["output_ids"]] == [4] * 6  # the answers as appended to the next turns
    _cache_consistent(r)


def test_generated_shared_prefix_against_cluster(cluster, tmp_path, capsys):
    out = tmp_path / "gsp.json"
    argv = [
        "--base-url", cluster.pd_router.url, "--dataset", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "32", "--gsp-question-len", "8",
        "--gsp-output-len", "4", "--concurrency", "3", "--metrics-url", cluster.prefill.url,
        "--metrics-url", cluster.decode.url, "--disable-tqdm", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert "workers hit %" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    assert (r["completed"], r["num_prompts"]) == (6, 6)
    assert r["input_lens"] == [40] * 6 and r["output_lens"] == [4] * 6
    assert "median_ttft_first_turn_ms" not in r
    _cache_consistent(r)
    decode = r["prefix_cache_workers"]["decode"]  # the decode worker's loads, apart from prefill's lookups
    assert decode["kv_bytes_read"] > 0 and [w["loads_kv"] for w in r["prefix_cache_workers"]["workers"]] == [
        False,
        True,
    ]
