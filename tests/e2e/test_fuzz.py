"""Hostile input against a real router (and the colocated worker behind it): the router's OpenAPI
schema fuzzed with schemathesis (valid and invalid bodies, wrong methods), then a hand list of
hostile bodies and requests. Every answer is a 4xx error object (OpenAI's, /v1/responses too;
Anthropic's on the Messages routes) or a success that matches the schema - never a 5xx, never a hang (every call has a timeout) - and afterwards the router and
the worker are healthy and a normal request still works.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.router.openai_protocol import MAX_STOP_STRINGS
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 96  # short generations keep each fuzzed request fast
MAX_EXAMPLES = 60  # per POST route and mode (derandomized: the same examples each run)
TIMEOUT_S = 30.0  # per call; a hang fails the test instead of stalling it
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.both = c.worker("colocated", "--max-model-len", str(MAX_MODEL_LEN))
        c.main = c.router("--request-timeout", "60", colocated=[c.both])
        c.wait_healthy()
        yield c


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/workers"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def api_schema(cluster):
    return schemathesis.openapi.from_url(f"{cluster.main.url}/openapi.json", timeout=TIMEOUT_S)


def test_schema_lists_exactly_the_public_routes(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# Generated requests: valid bodies (a success, or a refusal the schema documents) and, where a
# route takes a body, invalid ones (which must be refused with a 4xx). The GET routes take no
# input: a few calls check their answers against the schema.
FUZZ = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


# The pytest plugin (schemathesis.pytest) does not run on pytest 9, so hypothesis drives the
# schema's strategies here.
@pytest.mark.parametrize("method,path,mode", FUZZ, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZ])
def test_openapi_schema_fuzz(api_schema, method, path, mode):
    operation = api_schema[path][method]
    examples = MAX_EXAMPLES if method == "POST" else 3

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        statuses.add(case.call_and_validate(checks=CHECKS, timeout=TIMEOUT_S).status_code)

    statuses: set[int] = set()
    run()
    if mode == GenerationMode.POSITIVE:
        assert 200 in statuses, f"no generated request succeeded: {sorted(statuses)}"  # the successes were checked too


OK = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}


def _deep(n: int) -> bytes:
    return b'{"prompt": "x", "stream_options": ' + b'{"a": ' * n + b"1" + b"}" * n + b"}"


# (name, path, raw body, extra headers, status expected)
HOSTILE: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("deeply nested arrays", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400),
    ("deeply nested objects", "/v1/completions", _deep(50_000), {}, 400),
    ("a 5000-digit integer", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400),
    ("max_tokens above int64", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 30 + b"}", {}, 400),
    ("seed above int64", "/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 30 + b"}", {}, 400),
    ("a float overflowing to inf", "/v1/completions", b'{"prompt": "x", "temperature": 1e400}', {}, 400),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', {}, 400),
    ("Infinity", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}', {}, 400),
    ("-Infinity max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": -Infinity}', {}, 400),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', {}, 400),
    ("lone surrogate in model", "/v1/completions", b'{"prompt": "x", "model": "\\udfff"}', {}, 400),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', {}, 400),
    (
        "lone surrogate in chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        {},
        400,
    ),
    ("raw NUL byte in a string", "/v1/completions", b'{"prompt": "a\x00b"}', {}, 400),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400),
    ("10k stop strings", "/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * 10_000}).encode(), {}, 400),
    (
        "a 10k-character stop string",
        "/v1/completions",
        json.dumps({"prompt": "x", "stop": "a" * 10_000}).encode(),
        {},
        400,
    ),
    (
        "10k stop token ids",
        "/v1/completions",
        json.dumps({"prompt": "x", "stop_token_ids": [1] * 10_000}).encode(),
        {},
        400,
    ),
    ("negative max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": -1}', {}, 400),
    ("max_tokens past the context", "/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', {}, 400),
    (
        "a prompt past the context",
        "/v1/completions",
        json.dumps({"prompt": [1] * (MAX_MODEL_LEN + 1)}).encode(),
        {},
        400,
    ),
    ("n = 0", "/v1/completions", b'{"prompt": "x", "n": 0}', {}, 400),
    ("n = 129", "/v1/completions", b'{"prompt": "x", "n": 129}', {}, 400),
    (
        "top_logprobs = 21",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
        {},
        400,
    ),
    ("logprobs = 21", "/v1/completions", b'{"prompt": "x", "logprobs": 21}', {}, 400),
    ("a string for a number", "/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', {}, 400),
    ("a string for a boolean", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', {}, 400),
    ("a float for an integer", "/v1/completions", b'{"prompt": "x", "max_tokens": 2.5}', {}, 400),
    ("a prompt mixing types", "/v1/completions", b'{"prompt": [1, "a", null]}', {}, 400),
    ("token ids of the wrong sign", "/v1/completions", b'{"prompt": [-1]}', {}, 400),
    ("token ids past the vocabulary", "/v1/completions", b'{"prompt": [100000000]}', {}, 400),
    ("empty messages", "/v1/chat/completions", b'{"messages": []}', {}, 400),
    ("messages not a list", "/v1/chat/completions", b'{"messages": "hi"}', {}, 400),
    ("a message without content", "/v1/chat/completions", b'{"messages": [{"role": "user"}]}', {}, 400),
    ("a message of empty parts", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": []}]}', {}, 400),
    (
        "an image part",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        {},
        400,
    ),
    ("an unknown role", "/v1/chat/completions", b'{"messages": [{"role": "root", "content": "x"}]}', {}, 400),
    ("a message that is a number", "/v1/chat/completions", b'{"messages": [7]}', {}, 400),
    ("temperature 2.5", "/v1/completions", b'{"prompt": "x", "temperature": 2.5}', {}, 400),
    ("top_p 0", "/v1/completions", b'{"prompt": "x", "top_p": 0}', {}, 400),
    ("presence_penalty -3", "/v1/completions", b'{"prompt": "x", "presence_penalty": -3}', {}, 400),
    ("unknown model", "/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', {}, 404),
    ("best_of below n", "/v1/completions", b'{"prompt": "x", "n": 2, "best_of": 1}', {}, 400),
    (
        "stream_options without stream",
        "/v1/completions",
        b'{"prompt": "x", "stream_options": {"include_usage": true}}',
        {},
        400,
    ),
    ("truncated JSON", "/v1/completions", b'{"prompt": "x", "max_', {}, 400),
    ("an empty body", "/v1/completions", b"", {}, 400),
    ("a JSON array body", "/v1/completions", b"[1, 2]", {}, 400),
    ("a JSON null body", "/v1/chat/completions", b"null", {}, 400),
    ("text/plain", "/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 400),
    ("a form body", "/v1/completions", b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 400),
    ("multipart", "/v1/completions", b"--b\r\n\r\n--b--", {"content-type": "multipart/form-data; boundary=b"}, 400),
    ("a body over 8 MiB", "/v1/completions", json.dumps({"prompt": "x" * (9 << 20)}).encode(), {}, 413),
    (
        "a 7 MiB prompt (refused before tokenizing)",
        "/v1/completions",
        json.dumps({"prompt": "hello " * ((7 << 20) // 6)}).encode(),
        {},
        400,
    ),
    (
        "a 7 MiB chat message",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "y" * (7 << 20)}]}).encode(),
        {},
        400,
    ),
    ("a Responses input past the context", "/v1/responses", json.dumps({"input": "y" * (7 << 20)}).encode(), {}, 400),
    (
        "a Responses item of no known type",
        "/v1/responses",
        b'{"input": [{"type": "item_reference", "id": "x"}]}',
        {},
        400,
    ),
    ("previous_response_id", "/v1/responses", b'{"input": "x", "previous_response_id": "resp_1"}', {}, 400),
    ("an internal route", "/internal/generate", b"{}", {}, 404),
    ("an unknown route", "/v1/embeddings", b"{}", {}, 404),
]


@pytest.mark.parametrize("name,path,body,headers,status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(cluster, name, path, body, headers, status):
    started = time.monotonic()
    resp = httpx.post(
        f"{cluster.main.url}{path}",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=TIMEOUT_S,
    )
    assert resp.status_code == status, (name, resp.text[:300])
    err = resp.json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == "invalid_request_error"
    ), err
    assert time.monotonic() - started < 5.0, f"{name} took {time.monotonic() - started:.1f} s"


def test_field_errors_name_the_field(cluster):
    for body, param in (
        ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"messages": [{"role": "root", "content": "x"}]}, "messages.0.role"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        err = httpx.post(f"{cluster.main.url}{path}", json=body, timeout=TIMEOUT_S).json()["error"]
        assert err["param"] == param, (body, err)


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("PATCH", "/health", 405),
        ("GET", "/v2/anything", 404),
        ("GET", "/internal/info", 404),
    ],
)
def test_unsupported_routes_and_methods(cluster, method, path, status):
    resp = httpx.request(method, f"{cluster.main.url}{path}", timeout=TIMEOUT_S)
    assert resp.status_code == status and resp.json()["error"]["message"], resp.text
    if status == 405:
        assert resp.headers["allow"]


def _raw(url: str, data: bytes, read_s: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; what comes back before the server closes (or read_s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def _refused(call) -> bool:
    """A 4xx, or the server dropping the connection while the client still sends (a 1 MiB header
    is refused by the HTTP parser before it is all read); a timeout is not a refusal."""
    try:
        return 400 <= call().status_code < 500
    except httpx.TimeoutException:
        return False
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        return True


def test_hostile_http(cluster):
    url = cluster.main.url
    assert _refused(
        lambda: httpx.post(f"{url}/v1/completions", json=OK, headers={"x-big": "a" * (1 << 20)}, timeout=TIMEOUT_S)
    )
    many = httpx.post(
        f"{url}/v1/completions", json=OK, headers={f"x-h{i}": "v" for i in range(2000)}, timeout=TIMEOUT_S
    )
    assert many.status_code < 500
    gzip = httpx.post(
        f"{url}/v1/completions",
        content=b"\x1f\x8b garbage",
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=TIMEOUT_S,
    )
    assert gzip.status_code == 400
    # a body that lies about its length, a chunked body over the cap, and request-line garbage
    short = _raw(
        url,
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"',
        read_s=3,
    )
    assert not short.startswith(b"HTTP/1.1 5")
    chunks = b"".join(b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20)) for _ in range(9)) + b"0\r\n\r\n"
    chunked = _raw(
        url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks,
    )
    assert chunked.startswith(b"HTTP/1.1 413"), chunked[:200]
    assert _raw(url, b"\x00\x01garbage\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_healthy_and_serving_afterwards(cluster):
    """Runs last in this module: nothing above hurt the router or the worker."""
    for proc in cluster.procs:
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.log_tail()}"
        assert httpx.get(f"{proc.url}/health", timeout=TIMEOUT_S).status_code == 200
    resp = httpx.post(f"{cluster.main.url}/v1/completions", json=OK, timeout=TIMEOUT_S)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(f"{cluster.main.url}/metrics", timeout=TIMEOUT_S).text
    # /health answers 503 (documented) until the router's first probe of the worker
    five = [
        line
        for line in metrics.splitlines()
        if line.startswith("pdserve_router_requests_total") and 'status="5' in line and "/health" not in line
    ]
    assert five == [], five
