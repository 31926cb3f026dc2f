"""`pdserve bench --dataset agentic` without a server: the sessions' shape (seeded, one shared prefix,
lengths within their ranges, contexts under the cap), each turn sent as the previous prompt + the
answer + a tool output after the think time (the request sender replaced by a recording fake), the
level's agentic fields and table, and the flag checks."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from pdserve.bench import agentic, agentic_report, multiturn, sources
from pdserve.bench.cli import main, run_parser
from pdserve.bench.client import RequestOutput
from pdserve.bench.dataset import Conversation, Vocab

pytestmark = pytest.mark.timeout(60)
VOCAB = Vocab(5000, frozenset({0, 1, 2}), None)
SHAPE = agentic.AgenticShape(
    system_len=300, task_len=40, tool_output_len=(50, 400), output_len=(10, 60), max_context=3000, think_s=(0.0, 0.5)
)


def _contexts(conv: Conversation) -> list[int]:
    """Each turn's prompt + answer, with every answer as long as asked (ignore_eos)."""
    out = [len(conv.first) + conv.output_lens[0]]
    for tool, answer in zip(conv.appended, conv.output_lens[1:]):
        out.append(out[-1] + len(tool) + answer)
    return out


def test_sessions_are_seeded_and_share_one_prefix():
    a = agentic.sessions(8, SHAPE, VOCAB, random.Random("7:0"))
    assert a == agentic.sessions(8, SHAPE, VOCAB, random.Random("7:0"))
    assert a != agentic.sessions(8, SHAPE, VOCAB, random.Random("7:1"))
    prefixes = {tuple(s.first[: SHAPE.system_len]) for s in a}
    assert len(prefixes) == 1  # the system prompt and tool schemas: the same for every session
    assert len({tuple(s.first[SHAPE.system_len :]) for s in a}) == 8  # each its own task
    assert all(len(s.first) == SHAPE.system_len + SHAPE.task_len for s in a)
    assert not {t for s in a for t in s.first + [t for tool in s.appended for t in tool]} & VOCAB.excluded


def test_lengths_stay_in_their_ranges_and_contexts_under_the_cap():
    convs = agentic.sessions(20, SHAPE, VOCAB, random.Random(3))
    for s in convs:
        assert len(s.output_lens) == s.turns and len(s.think_s) == s.turns - 1
        assert all(50 <= len(tool) <= 400 for tool in s.appended)
        assert all(10 <= n <= 60 for n in s.output_lens)
        assert all(0.0 <= t <= 0.5 for t in s.think_s)
        contexts = _contexts(s)
        assert contexts == sorted(contexts) and contexts[-1] <= SHAPE.max_context
        assert contexts[-1] > SHAPE.max_context - 400 - 60  # it ended because the next turn could not fit
    assert max(s.turns for s in convs) >= 8  # ~3000 tokens in tool outputs of ~225: sessions of many turns
    one = agentic.AgenticShape(300, 40, (50, 400), (10, 60), 400, (0.0, 0.0))
    assert all(s.turns == 1 for s in agentic.sessions(4, one, VOCAB, random.Random(0)))  # no room for a second


def _fake_sender(sent: list[tuple[list[int], int, float]], fail_at: int | None = None):
    async def send(client, url, payload, headers, t0):
        sent.append((list(payload["prompt"]), payload["max_tokens"], asyncio.get_running_loop().time()))
        n = len(sent)
        out = RequestOutput(success=n != fail_at, error="" if n != fail_at else "HTTP 500: boom")
        out.prompt_tokens, out.output_tokens = len(payload["prompt"]), payload["max_tokens"]
        out.output_ids = [3000 + n] * payload["max_tokens"]
        out.ttft, out.latency = 0.01, 0.05
        return out

    return send


def _run(convs: list[Conversation], concurrency: int = 1) -> list[RequestOutput]:
    run = multiturn.run_conversations(
        "http://x", "/v1/completions", "m", convs, concurrency, float("inf"), random.Random(0)
    )
    return asyncio.run(run)[0]


def test_each_turn_is_the_last_prompt_the_answer_and_a_tool_output_after_the_think_time(monkeypatch):
    sent: list[tuple[list[int], int, float]] = []
    monkeypatch.setattr(multiturn, "send_request", _fake_sender(sent))
    shape = agentic.AgenticShape(30, 5, (10, 20), (3, 6), 200, (0.05, 0.05))
    (s,) = agentic.sessions(1, shape, VOCAB, random.Random(5))
    outs = _run([s])
    assert len(sent) == s.turns >= 3 and [o.turn for o in outs] == list(range(s.turns))
    assert sent[0][0] == s.first
    for k in range(1, s.turns):
        assert sent[k][0] == sent[k - 1][0] + outs[k - 1].output_ids + s.appended[k - 1]
        assert sent[k][2] - sent[k - 1][2] >= 0.05 - 1e-3  # the think time passed between the turns
    assert [m for _, m, _ in sent] == s.output_lens
    assert [o.prompt_tokens + o.output_tokens for o in outs] == _contexts(s)


def test_level_fields_sessions_speed_contexts_and_kv(monkeypatch):
    shape = agentic.AgenticShape(30, 5, (10, 20), (4, 4), 80, (0.0, 0.0))  # 2 or 3 turns a session
    convs = agentic.sessions(3, shape, VOCAB, random.Random(1))
    turns = convs[0].turns
    sent: list[tuple[list[int], int, float]] = []
    monkeypatch.setattr(multiturn, "send_request", _fake_sender(sent, fail_at=turns + 2))
    outs = _run(convs)  # one at a time: turn 1 of the second session fails
    assert [len(s) for s in agentic_report.split_sessions(outs)] == [c.turns for c in convs]
    decode = {"kv_bytes_read": 5_000_000, "kv_bytes_saved": 0, "saved_fraction": 0.0, "hits": 0}
    result = {"output_throughput": 120.0, "prefix_cache_workers": {"workers": [{"loads_kv": True}], "decode": decode}}
    f = agentic_report.level_fields(outs, result, gpus=4)
    assert (f["sessions"], f["sessions_completed"]) == (3, 2)
    assert f["turns_per_session"] == pytest.approx(len(outs) / 3)
    assert f["median_session_output_tps"] == pytest.approx(80.0)  # 4 tokens a 50 ms turn
    assert f["output_throughput_per_gpu"] == 30.0 and f["gpus"] == 4
    assert f["context_lens"][:turns] == _contexts(convs[0]) and f["context_lens"][turns + 1] is None
    assert f["mean_context_by_turn"][0] == pytest.approx(35 + 4)  # every session's first turn: prefix + task + answer
    assert f["max_context_len"] == max(c for c in f["context_lens"] if c is not None) <= 80
    assert (f["kv_bytes_moved"], f["kv_moved_from"]) == (5_000_000, "workers")
    router = {"output_throughput": 1.0, "ttft_breakdown": {"kv_transfers": 4, "kv_bytes_per_request": 250.0}}
    assert agentic_report.kv_moved(router) == (1000, "router")
    colocated = {"ttft_breakdown": {"kv_transfers": 0, "kv_bytes_per_request": None}}
    assert agentic_report.kv_moved(colocated) == (0, "router")
    assert agentic_report.kv_moved({"ttft_breakdown": {"error": "not pdserve"}}) == (None, None)
    assert agentic_report.level_fields(outs, router, gpus=None)["output_throughput_per_gpu"] is None

    table = agentic_report.format_table([{**result, **f, "max_concurrency": 1, "median_ttft_ms": 10.0}]).splitlines()
    cells = dict(zip(re.split(r"\s{2,}", table[0].strip()), table[2].split()))
    assert cells["sessions"] == "2/3" and cells["tok/s/GPU"] == "30.0" and cells["KV moved MB"] == "5.0"
    assert cells["TTFT p50"] == "10.0" and cells["TTFT p99"] == "-"  # not in this row: not known


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--endpoint", "/v1/chat/completions"], "use --endpoint /v1/completions"),
        (["--agentic-tool-output-len", "800", "100"], "--agentic-tool-output-len MIN MAX"),
        (["--agentic-output-len", "0", "10"], "--agentic-output-len MIN MAX"),
        (["--agentic-think-time", "-1", "1"], "--agentic-think-time MIN MAX"),
        (["--agentic-system-len", "0"], "--agentic-system-len must be positive"),
        (["--agentic-max-context", "8000"], "below a first turn's context (system + task + the longest answer = 9304)"),
        (["x.json"], "takes no file"),
    ],
)
def test_flag_checks(extra, message, capsys, tmp_path):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "r.json")]
    assert main([*argv, "--dataset", "agentic", *extra]) == 2
    assert message in capsys.readouterr().err


def test_max_context_past_the_servers_max_model_len_is_refused():
    args = run_parser().parse_args(["--dataset", "agentic", "--agentic-max-context", "65536"])
    sources.check_dataset(args)
    with pytest.raises(ValueError, match="65536 passes m's max_model_len 4096"):
        sources.prompt_source(args, "m", [{"id": "m", "max_model_len": 4096}])
    make, _ = sources.prompt_source(args, "m", [{"id": "m", "max_model_len": 131072}])
    assert callable(make)
