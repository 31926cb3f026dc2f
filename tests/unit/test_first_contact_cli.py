"""First contact (issue 29, item 5): launch's serve flags over the config, a partial config that
merges with the defaults, `pdserve health` and `pdserve bench` with an API key (and a clear 401),
bench's defaults in --help and its results folder, logprobs' bytes of a token that is part of a
UTF-8 character. No process is started: real HTTP servers on threads stand in for the router."""

import json
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pdserve.cli import main
from pdserve.config import ConfigError, load_config, resolve_model
from pdserve.launch.flags import apply_flags, load_cluster
from pdserve.router.token_bytes import TokenBytes
from pdserve.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)
KEY = "sk-first-contact"


class _Keyed(BaseHTTPRequestHandler):
    """/health and /v1/models behind Authorization: Bearer KEY, as the router with an API key."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        ok = self.headers.get("Authorization") == f"Bearer {KEY}"
        body = {"status": "ok"} if self.path == "/health" else {"object": "list", "data": [{"id": "tiny"}]}
        if not ok:
            body = {"error": {"message": "invalid API key", "type": "invalid_request_error", "code": "invalid_api_key"}}
        data = json.dumps(body).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def keyed_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Keyed)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_health_says_401_is_a_wrong_key_and_uses_the_key(keyed_server, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["health", "--url", keyed_server, "--status", "/nonexistent"]) == 1
    out = capsys.readouterr().out
    assert "401: wrong or missing API key" in out and "DOWN" not in out
    assert main(["health", "--url", keyed_server, "--api-key", KEY, "--status", "/nonexistent"]) == 0
    assert " ok " in capsys.readouterr().out
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what the OpenAI clients read serves too
    assert main(["health", "--url", keyed_server, "--status", "/nonexistent"]) == 0


def test_bench_says_401_is_a_wrong_key_even_with_a_model(keyed_server, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    argv = ["bench", "--base-url", keyed_server, "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "401: wrong or missing API key" in err and "pass --model" not in err
    assert main([*argv, "--model", "tiny"]) == 2
    assert "401: wrong or missing API key" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written for a run that never started


def test_bench_help_shows_defaults_and_results_go_to_a_folder(capsys, monkeypatch, tmp_path):
    from pdserve.bench.cli import out_file

    monkeypatch.setenv("COLUMNS", "250")  # one line a flag
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "(default: 256)" in out and "(default: bench-results)" in out and "(default: /v1/completions)" in out
    monkeypatch.chdir(tmp_path)
    path = Path(out_file("bench-results"))
    assert path.parent == Path("bench-results") and path.parent.is_dir() and path.name.startswith("pdserve-bench-")
    assert out_file(str(tmp_path / "r.json")) == str(tmp_path / "r.json")


def _flags(**given) -> Namespace:
    names = ("model", "served_model_name", "api_key", "port", "router_host", "prefill_port", "decode_port",
             "colocated_port", "tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "num_kv_blocks", "kv_cache_dtype", "enforce_eager")  # fmt: skip
    return Namespace(**{n: given.get(n) for n in names})


def test_launch_flags_override_the_config():
    cfg = apply_flags(
        load_config(),
        _flags(
            api_key=KEY, port=9000, served_model_name="m", tensor_parallel_size=2, prefill_port=31000, max_num_seqs=8
        ),
    )
    assert (cfg.router.api_key, cfg.router.port, cfg.served_model_name) == (KEY, 9000, "m")
    assert [(w.port, w.tp_size, w.max_num_seqs) for _, w in cfg.named_workers()] == [(31000, 2, 8), (30001, 2, 8)]
    assert cfg.router.health_interval == load_config().router.health_interval  # the rest is the config's
    assert apply_flags(load_config(), _flags()) == load_config()
    with pytest.raises(ConfigError, match=r"router.port: Input should be greater than or equal to 1"):
        apply_flags(load_config(), _flags(port=0))


def test_launch_help_lists_the_serve_flags(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = capsys.readouterr().out
    for flag in ("--api-key", "--model", "--port", "--tensor-parallel-size", "--served-model-name", "--decode-port"):
        assert flag in out


def test_a_partial_config_merges_with_the_defaults(tmp_path):
    path = tmp_path / "key.yaml"
    path.write_text(yaml.safe_dump({"router": {"api_key": KEY}}))
    cfg = load_cluster(str(path))
    assert cfg.router.api_key == KEY and cfg.model == load_config().model
    assert [n for n, _ in cfg.named_workers()] == ["prefill-0", "decode-0"]
    path.write_text(yaml.safe_dump({"colocated": [{"port": 30002}]}))  # its own workers only
    assert [n for n, _ in load_cluster(str(path)).named_workers()] == ["colocated-0"]
    path.write_text(yaml.safe_dump({"router": {"api_key": KEY}, "prefill": [{"port": 30000}]}))
    with pytest.raises(ConfigError, match="PD needs both prefill and decode workers"):
        load_cluster(str(path))


def test_logprob_bytes_of_a_token_inside_a_utf8_character():
    tok = Tokenizer(resolve_model("tiny:deepseek_v3"))
    tb = TokenBytes(tok)
    text = "a 中é, naïve ✓"
    ids = tok.encode(text, add_special_tokens=False)
    parts = [bytes(tb.of(i)) for i in ids]
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some tokens are parts of a character
    assert b"".join(parts) == text.encode()
    assert all(p and p != "\ufffd".encode() for p in parts)
    eos = tok.eos_token_id
    assert bytes(tb.of(eos)) == tok.decode([eos], skip_special_tokens=False).encode()  # an added token: its text


async def test_a_decode_worker_on_trial_is_a_503_not_a_500():
    """Found by scripts/chaos.py: a half-open breaker counts as available but takes one trial
    request at a time; a second request meanwhile got "no worker to choose from" as a 500."""
    import aiohttp

    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.policies import RoundRobin
    from pdserve.router.pool import WorkerPool
    from pdserve.sampling_params import SamplingParams
    from pdserve.wire.errors import OpenAIError

    clock = [0.0]
    pool = WorkerPool(["http://w:1"], ["http://w:2"], [], RouterMetrics())
    for w in pool.workers:
        w.healthy = True
        w.breaker.clock = lambda: clock[0]
    decode = pool.workers[1]
    for _ in range(decode.breaker.threshold):
        decode.breaker.record_failure()
    clock[0] += decode.breaker.cooldown_s  # half-open now
    pool.acquire(decode)  # its trial request is in flight
    assert pool.can_pd() and not pool.candidates("decode")
    async with aiohttp.ClientSession() as client:
        d = Dispatcher(pool, client, RoundRobin(), RoundRobin(), {}, RouterMetrics())
        with pytest.raises(OpenAIError) as err:
            await anext(d.generate("r", [1, 2], SamplingParams(max_tokens=2)))
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "2"}
    assert "no decode worker takes requests now" in str(err.value)


def test_chat_logprobs_carry_the_token_bytes():
    from pdserve.outputs import LogprobEntry
    from pdserve.router.responses import ChatFormatter

    tok = Tokenizer(resolve_model("tiny:deepseek_v3"))
    ids = tok.encode("中", add_special_tokens=False)  # three byte tokens, each U+FFFD on its own
    fmt = ChatFormatter("r", "tiny", tok, [[1]], 1, False, False)
    steps = [[LogprobEntry(token_id=i, logprob=-0.5, rank=1, token=tok.decode([i]))] for i in ids]
    content = fmt._logprobs(steps).content
    assert [c.token for c in content] == ["\ufffd"] * 3
    assert b"".join(bytes(c.bytes) for c in content) == "中".encode()
    assert [t.bytes for c in content for t in c.top_logprobs] == [c.bytes for c in content]
