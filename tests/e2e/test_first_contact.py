"""What a new user meets first: stopping with a request in flight, `tiny:` wherever a model folder
goes, `pdserve bench` defaults and its plotting extra, the numactl test's skip where numactl is absent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench import cli as bench_cli
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stopping_the_router_ends_an_open_stream_with_an_error_event(tmp_path):
    with Cluster(make_tiny_model(tmp_path / "tiny"), tmp_path / "logs") as c:
        worker = c.worker("colocated")
        router = c.router(colocated=[worker])
        c.wait_healthy()
        body = {
            "model": "tiny",
            "prompt": "stream until stopped",
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{router.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(4)]  # streaming
            t0 = time.monotonic()
            router.popen.send_signal(signal.SIGTERM)
            rest = list(lines)
            ended_s = time.monotonic() - t0
        errors = [json.loads(line[6:])["error"] for line in rest if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["code"] == "server_shutting_down", rest[-3:]
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
        assert router.popen.wait(timeout=10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once stopped
        assert ended_s < 2.0  # not the 5 s graceful-shutdown limit
        assert "ERROR" not in router.log.read_text()
        deadline = time.monotonic() + 10  # the worker's copy of the request was aborted
        while httpx.get(f"{worker.url}/health").json()["kv_blocks_used"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_llm_takes_tiny_models(tmp_path, monkeypatch):
    from pdserve import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    llm = LLM("tiny:deepseek_v3", num_kv_blocks=32, kv_block_size=16)
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert (tmp_path / "tiny-deepseek_v3-seed0" / "config.json").is_file()
    with pytest.raises(ValueError, match="unknown tiny model"):
        LLM("tiny:gpt2")


def test_bench_defaults_need_no_flags(tmp_path, monkeypatch):
    args = bench_cli.run_parser().parse_args([])
    assert args.base_url == "http://127.0.0.1:8000" and args.out == "bench-results"
    monkeypatch.chdir(tmp_path)
    out = bench_cli.out_file(args.out)  # a file in the folder, not in the current directory
    assert (
        out.startswith("bench-results/pdserve-bench-")
        and out.endswith(".json")
        and (tmp_path / "bench-results").is_dir()
    )


def test_bench_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench_cli.main(["--plot", "x.png", "--base-url", "http://127.0.0.1:1"]) == 2
    assert "pip install 'pdserve[bench]'" in capsys.readouterr().err
    assert bench_cli.main(["plot", "a.json", "-o", "x.png"]) == 2
    assert "plotting needs matplotlib" in capsys.readouterr().err


def test_numactl_test_skips_and_says_why_without_numactl(tmp_path):
    """Where numactl is absent the NUMA test is skipped with the reason, not failed."""
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}  # a PATH with no numactl
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/unit/test_numa.py::test_numactl_pins_a_real_child"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "numactl is not installed" in out.stdout
