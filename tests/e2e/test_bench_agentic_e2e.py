"""`pdserve bench --dataset agentic` against a real tiny PD cluster (prefill + decode over NIXL, the
prefix cache on, as by default): every turn's prompt is the one the seed planned (the previous
prompt + the answer + the tool output), later turns find their prefix cached, and the report holds
the agentic fields with sane values."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.bench import agentic, dataset
from pdserve.bench.cli import main
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.timeout(180)
SHAPE = agentic.AgenticShape(
    system_len=128, task_len=16, tool_output_len=(32, 96), output_len=(4, 12), max_context=512, think_s=(0.01, 0.05)
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.prefill = c.worker("prefill")
        c.decode = c.worker("decode", peers=[c.prefill])
        c.router_proc = c.router(prefill=[c.prefill], decode=[c.decode])
        c.wait_healthy()
        yield c


def _planned(model_dir: str, level: int, num: int) -> list[dataset.Conversation]:
    """The sessions `pdserve bench --seed 3` sends at that level (the tiny model's vocabulary)."""
    return agentic.sessions(num, SHAPE, dataset.load_vocab([model_dir]), random.Random(f"3:{level}"))


def _prompt_lens(conv: dataset.Conversation) -> list[int]:
    lens = [len(conv.first)]
    for k, tool in enumerate(conv.appended):
        lens.append(lens[-1] + conv.output_lens[k] + len(tool))
    return lens


def test_agentic_sessions_against_cluster(cluster, tmp_path, capsys):
    out = tmp_path / "agentic.json"
    argv = [
        "--base-url", cluster.router_proc.url, "--dataset", "agentic", "--seed", "3",
        "--agentic-system-len", "128", "--agentic-task-len", "16", "--agentic-tool-output-len", "32", "96",
        "--agentic-output-len", "4", "12", "--agentic-max-context", "512", "--agentic-think-time", "0.01", "0.05",
        "--concurrency", "1,2", "--num-prompts", "2,3", "--num-gpus", "2",
        "--metrics-url", cluster.prefill.url, "--metrics-url", cluster.decode.url, "--disable-tqdm", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tok/s/session" in printed and "KV moved MB" in printed and "hit %" in printed

    doc = json.loads(out.read_text())
    assert doc["config"]["agentic_tool_output_len"] == [32, 96]
    for level, (r, num) in enumerate(zip(doc["results"], (2, 3))):
        planned = _planned(cluster.model_dir, level, num)
        # the server's own prompt counts: each turn the previous prompt + the answer + the tool output
        assert r["input_lens"] == [n for s in planned for n in _prompt_lens(s)]
        assert r["output_lens"] == [n for s in planned for n in s.output_lens]
        assert r["turns"] == [k for s in planned for k in range(s.turns)]
        assert (r["sessions"], r["sessions_completed"], r["failed"]) == (num, num, 0)
        assert all(c <= 512 for c in r["context_lens"]) and r["max_context_len"] == max(r["context_lens"])
        assert r["max_context_len"] > 512 - 96 - 12  # sessions ran to the cap
        by_turn = r["mean_context_by_turn"]
        assert len(by_turn) == max(s.turns for s in planned) and by_turn == sorted(by_turn)
        # later turns find the previous prompt in the prefill worker's cache (64-token blocks)
        later = [c for c, k in zip(r["cached_lens"], r["turns"]) if k > 0]
        assert later and all(c >= 64 for c in later)
        assert 0 < r["total_cached_tokens"] and r["prefill_tokens_computed"] < r["total_input_tokens"]
        assert r["prefix_cache_workers"]["hit_rate"] > 0
        assert r["kv_moved_from"] == "workers" and r["kv_bytes_moved"] > 0
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["median_session_output_tps"] > 0 and r["mean_session_output_tps"] > 0
        assert r["gpus"] == 2 and r["output_throughput_per_gpu"] == pytest.approx(r["output_throughput"] / 2)
