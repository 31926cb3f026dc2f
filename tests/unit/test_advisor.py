"""PD advisor verdicts on synthetic result files of known shape, and the worker
metrics it reads (real prometheus_client text, served over HTTP for --live)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest, start_http_server

from pdserve.bench import advisor, workers
from pdserve.bench.cli import main

pytestmark = pytest.mark.timeout(60)


def level(c: int, tput: float, ttft: float, itl_p99: float, tpot: float, **extra) -> dict:
    return {
        "max_concurrency": c,
        "completed": 32,
        "failed": 0,
        "output_throughput": tput,
        "median_ttft_ms": ttft,
        "p99_itl_ms": itl_p99,
        "median_tpot_ms": tpot,
        **extra,
    }


def doc(*levels: dict) -> dict:
    return {"results": list(levels), "config": {}, "date": "2025-01-01T00:00:00+00:00", "server": {}}


# The reference deployment: ~25 tok/s at every concurrency on both, TPOT ~ proportional to batch.
DECODE_BOUND_COLOCATED = doc(
    level(1, 25.0, 150, 45, 40), level(8, 25.5, 900, 330, 315), level(16, 24.8, 2100, 700, 640)
)
DECODE_BOUND_PD = doc(level(1, 25.2, 120, 44, 39.5), level(8, 25.6, 700, 320, 312), level(16, 25.1, 1900, 690, 630))


def test_decode_bound_flat_throughput():
    v = advisor.advise(DECODE_BOUND_COLOCATED, DECODE_BOUND_PD, colocated_gpus=4, pd_gpus=8)
    assert v.kind == "decode_bound"
    assert "PD uses 2.0x the GPUs for 1.00x the throughput" in v.headline
    assert "x1.00 from c=1 to c=16" in v.headline
    assert "decode step is the ceiling" in v.headline
    assert "TPOT grows x15.9" in v.headline  # 630 / 39.5
    assert v.numbers["gpu_ratio"] == 2.0
    assert v.numbers["throughput_ratio"] == pytest.approx(25.6 / 25.5)
    assert v.numbers["pd_throughput_scaling"] == pytest.approx(25.1 / 25.2)


def test_decode_bound_uses_recorded_worker_metrics():
    pd = json.loads(json.dumps(DECODE_BOUND_PD))
    pd["results"][-1]["worker_metrics"] = {
        "window_s": 160.0,
        "decode_steps": 250,
        "mean_decode_step_ms": 630.0,
        "decode_busy_fraction": 0.98,
        "prefill_steps": 32,
        "mean_prefill_step_ms": 150.0,
        "prefill_busy_fraction": 0.03,
        "mean_decode_batch": 15.6,
        "mean_running": 16.0,
    }
    v = advisor.advise(DECODE_BOUND_COLOCATED, pd)
    assert v.kind == "decode_bound"
    assert "decode busy 98% of the time at 630.0 ms a step" in v.headline
    assert "prefill busy 3%" in v.headline
    assert v.numbers["decode_busy_fraction"] == 0.98


def test_flat_but_idle_decode_is_not_decode_bound():
    idle = {"window_s": 60.0, "decode_steps": 100, "mean_decode_step_ms": 30.0, "decode_busy_fraction": 0.2}
    v = advisor.advise(DECODE_BOUND_COLOCATED, DECODE_BOUND_PD, workers=idle)
    assert v.kind == "no_gain"
    assert "decode is busy only 20%" in v.headline


def test_prefill_interference():
    colocated = doc(level(1, 30, 100, 40, 33), level(8, 180, 450, 260, 45), level(16, 280, 900, 480, 58))
    pd = doc(level(1, 31, 70, 34, 32), level(8, 190, 160, 60, 40), level(16, 300, 300, 72, 52))
    v = advisor.advise(colocated, pd)
    assert v.kind == "prefill_interference"
    assert v.numbers["ttft_cut"] == pytest.approx(1 - 300 / 900)
    assert v.numbers["itl_p99_cut"] == pytest.approx(1 - 72 / 480)
    assert "cuts median TTFT by 67% and cuts p99 ITL by 85% at c=16" in v.headline
    assert "PD uses 2.0x the GPUs for 1.07x the throughput" in v.headline


def test_pd_helps_throughput():
    colocated = doc(level(1, 30, 100, 40, 33), level(8, 120, 400, 80, 60), level(16, 150, 900, 120, 100))
    pd = doc(level(1, 32, 90, 38, 31), level(8, 200, 200, 50, 38), level(16, 330, 300, 60, 45))
    v = advisor.advise(colocated, pd, colocated_gpus=1, pd_gpus=2)
    assert v.kind == "pd_helps_throughput"
    assert v.numbers["throughput_ratio"] == pytest.approx(2.2)
    assert "2.20x the throughput (1.10x per GPU)" in v.headline
    # The same numbers on 4x the GPUs: a gain, but less per GPU than colocated replicas.
    v4 = advisor.advise(colocated, pd, colocated_gpus=1, pd_gpus=4)
    assert v4.kind == "pd_helps_throughput" and "colocated replicas" in v4.headline


def test_no_gain_while_throughput_still_scales():
    colocated = doc(level(1, 30, 100, 40, 33), level(16, 300, 200, 60, 50))
    pd = doc(level(1, 31, 98, 41, 32), level(16, 310, 190, 58, 49))
    v = advisor.advise(colocated, pd)
    assert v.kind == "no_gain"
    assert "still grows with concurrency (x10.00 from c=1 to c=16)" in v.headline


def test_advise_rejects_files_without_common_levels():
    with pytest.raises(ValueError, match="no concurrency level completed requests in both"):
        advisor.advise(doc(level(1, 1, 1, 1, 1)), doc(level(8, 1, 1, 1, 1)))
    with pytest.raises(ValueError, match="GPU counts must be positive"):
        advisor.advise(DECODE_BOUND_COLOCATED, DECODE_BOUND_PD, pd_gpus=0)


def test_advise_cli_prints_verdict(tmp_path, capsys):
    col, pd = tmp_path / "colocated.json", tmp_path / "pd.json"
    col.write_text(json.dumps(DECODE_BOUND_COLOCATED))
    pd.write_text(json.dumps(DECODE_BOUND_PD))
    assert main(["advise", str(col), str(pd), "--colocated-gpus", "4", "--pd-gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: decode_bound\n")
    assert "c=16: output 24.8 -> 25.1 tok/s" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["advise", str(bad), str(pd)]) == 2
    assert "not a pdserve bench results file" in capsys.readouterr().err


def _registry() -> tuple[CollectorRegistry, Histogram, Histogram, Gauge]:
    reg = CollectorRegistry()
    decode = Histogram(workers.DECODE_STEP, "decode step", ["model"], registry=reg)
    prefill = Histogram(workers.PREFILL_STEP, "prefill step", ["model"], registry=reg)
    running = Gauge(workers.RUNNING, "running", ["model"], registry=reg)
    return reg, decode, prefill, running


def test_worker_stats_from_prometheus_text():
    reg, decode, prefill, _ = _registry()
    decode.labels("tiny").observe(0.5)
    before = workers.parse_metrics(generate_latest(reg).decode())
    for _ in range(4):
        decode.labels("tiny").observe(0.2)
    prefill.labels("tiny").observe(0.1)
    after = workers.parse_metrics(generate_latest(reg).decode())
    stats = workers.worker_stats([before], [after], window_s=1.0)
    assert stats["decode_steps"] == 4
    assert stats["mean_decode_step_ms"] == pytest.approx(200.0)
    assert stats["decode_busy_fraction"] == pytest.approx(0.8)
    assert stats["prefill_steps"] == 1 and stats["prefill_busy_fraction"] == pytest.approx(0.1)
    assert stats["mean_decode_batch"] is None  # not exported by this worker
    with pytest.raises(ValueError, match="window must be positive"):
        workers.worker_stats([before], [after], window_s=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_advise_live_reads_worker_metrics(tmp_path, capsys):
    reg, decode, _, running = _registry()
    port = _free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    stop = threading.Event()

    def busy_decode():  # a decode worker stepping back to back: 50 ms steps, batch of 16
        running.labels("tiny").set(16)
        while not stop.is_set():  # each step observes what it really took: back to back, whatever the load
            t0 = time.monotonic()
            time.sleep(0.05)
            decode.labels("tiny").observe(time.monotonic() - t0)

    load = threading.Thread(target=busy_decode)
    load.start()
    try:
        col, pd = tmp_path / "colocated.json", tmp_path / "pd.json"
        col.write_text(json.dumps(DECODE_BOUND_COLOCATED))
        pd.write_text(json.dumps(DECODE_BOUND_PD))
        rc = main(
            ["advise", str(col), str(pd), "--live", "--metrics-url", f"http://127.0.0.1:{port}", "--watch", "1.5"]
        )
    finally:
        stop.set()
        load.join()
        server.shutdown()
        thread.join()
    out = capsys.readouterr().out
    assert rc == 0
    assert "verdict: decode_bound" in out
    assert "decode busy 9" in out or "decode busy 100%" in out  # >= 90% of the window in steps
    mean_ms = float(re.search(r"at (\d+\.\d+)", out).group(1))
    assert 50.0 <= mean_ms < 80.0, out  # mean step ~50 ms (a loaded machine oversleeps a little)
    assert main(["advise", str(col), str(pd), "--live"]) == 2


def test_gpu_counts_read_from_the_runs():
    """The files' deployments give the GPU counts (flags override); PD on one GPU says it shares it."""
    col, pd = json.loads(json.dumps(DECODE_BOUND_COLOCATED)), json.loads(json.dumps(DECODE_BOUND_PD))
    col["deployment"] = {"workers": {"colocated": 1}, "gpus": 1}
    pd["deployment"] = {"workers": {"prefill": 1, "decode": 1}, "gpus": 1}
    v = advisor.advise(col, pd)
    assert (v.numbers["colocated_gpus"], v.numbers["pd_gpus"], v.numbers["gpu_ratio"]) == (1, 1, 1.0)
    assert "PD uses 1.0x the GPUs" in v.headline
    assert (
        v.evidence[0]
        == "GPUs: colocated 1 (read from the run (1 colocated worker(s) on 1 GPU(s))); PD 1 (read from the run (1 decode, 1 prefill worker(s) on 1 GPU(s)))"
    )
    assert v.evidence[1].startswith("PD runs 2 workers on 1 GPU(s): prefill and decode processes share them")
    v = advisor.advise(col, pd, pd_gpus=2)
    assert v.numbers["gpu_ratio"] == 2.0 and "PD 2 (given)" in v.evidence[0]
    del pd["deployment"]
    assert "PD 2 (assumed" in advisor.advise(col, pd).evidence[0]


def test_ttft_breakdown_in_the_evidence():
    col, pd = json.loads(json.dumps(DECODE_BOUND_COLOCATED)), json.loads(json.dumps(DECODE_BOUND_PD))
    col["results"][-1]["ttft_breakdown"] = {
        "requests": 32,
        "router_mean_ttft_ms": 2000.0,
        "ttft_ms": {"queue": 1500.0, "prefill": 480.0, "other": 20.0},
    }
    pd["results"][-1]["ttft_breakdown"] = {
        "requests": 32, "router_mean_ttft_ms": 1800.0, "ttft_ms": {"queue": 1400.0, "prefill": 380.0, "other": 20.0},
        "kv_bytes_per_request": 48e6, "kv_gb_per_s": 12.0, "kv_transfers": 32, "handoffs_via": {"prefill": 30, "router": 2},
        "handoff_ms": {"dispatch": 3.0, "decode_queue": 10.0, "kv_transfer": 4.0, "first_decode": 60.0, "other": 3.0},
    }  # fmt: skip
    v = advisor.advise(col, pd)
    lines = "\n".join(v.evidence)
    assert "c=16: colocated TTFT 2000.0 ms (router, mean) = queue 1500.0 + prefill 480.0 + other 20.0 ms" in lines
    assert "c=16: PD TTFT 1800.0 ms (router, mean) = queue 1400.0 + prefill 380.0 + other 20.0 ms" in lines
    assert (
        "PD hand-off, first token -> decode's first token, 80.0 ms (mean) = dispatch 3.0 + decode queue 10.0 + kv transfer 4.0"
        in lines
    )
    assert "(48.0 MB a request at 12.00 GB/s; 30 handed off engine to engine, 2 posted by the router)" in lines
    assert (v.numbers["pd_kv_transfer_ms"], v.numbers["pd_handoff_ms"], v.numbers["pd_kv_gb_per_s"]) == (
        4.0,
        80.0,
        12.0,
    )


def test_prefix_cache_hit_rates_in_the_evidence():
    """Each side's hit rate from usage (or, without it, the workers' counters); none where none was reported."""
    col = json.loads(json.dumps(DECODE_BOUND_COLOCATED))
    pd = json.loads(json.dumps(DECODE_BOUND_PD))
    col["results"][-1].update(total_input_tokens=1000, prefix_cache_hit_rate=0.8, prefill_tokens_computed=200)
    pd["results"][-1].update(
        total_input_tokens=1000,
        prefix_cache_hit_rate=None,
        prefix_cache_workers={"hit_rate": 0.5, "computed_tokens": 500, "queries": 1000, "hits": 500},
    )
    v = advisor.advise(col, pd, colocated_gpus=1, pd_gpus=2)
    (line,) = [e for e in v.evidence if "prefix cache" in e]
    assert line == (
        "c=16: prefix cache: colocated hit rate 80%, 200 of 1000 prompt tokens computed (usage); "
        "PD hit rate 50%, 500 of 1000 prompt tokens computed (worker counters)"
    )
    assert v.numbers["colocated_prefix_cache_hit_rate"] == 0.8 and v.numbers["pd_prefix_cache_hit_rate"] == 0.5
    plain = advisor.advise(DECODE_BOUND_COLOCATED, DECODE_BOUND_PD, colocated_gpus=1, pd_gpus=2)
    assert not [e for e in plain.evidence if "prefix cache" in e]
    assert plain.numbers["pd_prefix_cache_hit_rate"] is None
