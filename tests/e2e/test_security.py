"""Security with real processes: the router's --api-key on every route (as a Bearer token or x-api-key); workers and their NIXL/UCX
listeners on loopback by default; a worker bound elsewhere serving /internal/* (transfer metadata
included) only to holders of the cluster secret; NIXL metadata fetched only from configured peers;
request bodies capped; and no code path that unpickles or evaluates what it is sent.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.tiny_model import make_tiny_model
from pdserve.wire.http import TokenGuard
from tests.helpers.cluster import SECRET, Cluster, free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-pdserve-security"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
T = 30.0  # seconds, every client call


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.model = root / "tiny"
        c.prefill = c.worker("prefill")
        c.decode = c.worker("decode", peers=[c.prefill])
        c.exposed = c.worker("prefill", "--host", "0.0.0.0")  # bound beyond loopback; not a peer of decode
        c.keyed = c.router("--api-key", API_KEY, prefill=[c.prefill], decode=[c.decode])
        c.stranger = c.router(prefill=[c.exposed], decode=[c.decode])
        c.wait_healthy()
        yield c


def _is_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:300]
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- the API key --

PROTECTED = [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health"),
    ("GET", "/workers"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"),
    ("DELETE", "/v1/models"),
]  # fmt: skip
BAD_CREDENTIALS = [
    {},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer sk-wrong"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": API_KEY},
    {"X-Api-Key": f"{API_KEY}x"},
    {"X-Api-Key": f"Bearer {API_KEY}"},
]


@pytest.mark.parametrize("method,path", PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_api_key_guards_every_route(cluster, method, path):
    url = f"{cluster.keyed.url}{path}"
    for headers in BAD_CREDENTIALS:
        resp = httpx.request(method, url, headers=headers, json=GOOD if method == "POST" else None, timeout=T)
        err = _is_error(resp, 401)
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"
    for headers in (AUTH, {"X-Api-Key": API_KEY}):  # x-api-key: as Anthropic clients send the key
        ok = httpx.request(method, url, headers=headers, json=GOOD if method == "POST" else None, timeout=T)
        assert ok.status_code != 401
        if method == "GET" and path != "/no/such/route":
            assert ok.status_code == 200, ok.text[:300]


def test_api_key_lets_a_request_through_the_pd_path(cluster):
    resp = httpx.post(
        f"{cluster.keyed.url}/v1/completions", json=GOOD, headers={"authorization": f"bearer {API_KEY}"}, timeout=T
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_api_key_refuses_a_huge_body_without_reading_it(cluster):
    body = b"x" * (64 << 20)  # far past the body cap: the 401 comes first
    resp = httpx.post(
        f"{cluster.keyed.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=T
    )
    assert resp.status_code == 401


def test_health_cli_sends_the_key(cluster):
    def health(*extra: str, env: dict | None = None) -> int:
        cmd = [sys.executable, "-m", "pdserve", "health", "--url", cluster.keyed.url, "--timeout", "5", *extra]
        return subprocess.run(cmd, capture_output=True, timeout=60, env=env).returncode

    assert health() == 1
    assert health("--api-key", API_KEY) == 0
    assert health(env={**_env(), "PDSERVE_API_KEY": API_KEY}) == 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}


def test_launch_waits_for_a_keyed_router():
    from pdserve.config import ClusterConfig
    from pdserve.launch import plan

    cfg = ClusterConfig.model_validate(
        {"model": "tiny:deepseek_v3", "router": {"api_key": API_KEY}, "colocated": [{"port": 30002}]}
    )
    router = plan(cfg, "/m")[-1]
    assert router.headers == AUTH  # launch's /health poll of the router sends the key


async def test_token_comparison_is_constant_time(monkeypatch):
    """Every check compares two SHA-256 digests with hmac.compare_digest: equal lengths whatever
    was sent, so neither the key's length nor a matching prefix shortens the comparison."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = TokenGuard(app, token=API_KEY, header="authorization", protects=lambda _: True, what="API key")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://r") as client:
        for given in ("", "s", API_KEY[:-1], API_KEY + "x" * 1000, API_KEY):
            status = (await client.get("/", headers={"authorization": f"Bearer {given}"})).status_code
            assert status == (204 if given == API_KEY else 401)
    assert len(seen) == 5
    assert all(len(a) == len(b) == 32 for a, b in seen)
    assert seen[-1][1] == hashlib.sha256(API_KEY.encode()).digest()


# -- workers: loopback by default, the cluster secret beyond it --


def _listening(proc) -> list[str]:
    conns = psutil.Process(proc.popen.pid).net_connections("inet")
    return sorted({c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN})


def test_workers_and_their_transfer_listeners_stay_on_loopback(cluster):
    for worker in (cluster.prefill, cluster.decode):
        ips = _listening(worker)
        assert ips and all(ipaddress.ip_address(ip).is_loopback for ip in ips), (worker.name, ips)
    assert "0.0.0.0" in _listening(cluster.exposed)  # the exposed worker really is bound beyond loopback


def test_a_worker_beyond_loopback_needs_a_secret(cluster):
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        "--role",
        "colocated",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--model",
        str(cluster.model),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cluster-secret" in proc.stderr


def _external_ip() -> str:
    """An address of this host other than loopback (where the exposed worker is reachable from
    the network), or loopback where the host has none."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return "127.0.0.1"


INTERNAL = [
    ("GET", "/internal/info", None), ("GET", "/internal/kv_metadata", None), ("POST", "/internal/abort", {"request_id": "r"}),
    ("GET", "/openapi.json", None),
    ("POST", "/internal/generate", {"request_id": "r", "prompt_token_ids": [1], "params": {"max_tokens": 1}, "hold_kv": True}),
]  # fmt: skip


def test_exposed_worker_serves_only_secret_holders(cluster):
    base = cluster.exposed.url.replace("127.0.0.1", _external_ip())
    for method, path, body in INTERNAL:
        for headers in (
            {},
            {"x-pdserve-cluster-secret": "wrong"},
            {"x-pdserve-cluster-secret": SECRET + "x"},
            {"Authorization": f"Bearer {SECRET}"},
        ):
            err = _is_error(httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=T), 401)
            assert "cluster secret" in err["message"]
    secret = {"x-pdserve-cluster-secret": SECRET}
    assert httpx.get(f"{base}/internal/info", headers=secret, timeout=T).json()["role"] == "prefill"
    meta = httpx.get(f"{base}/internal/kv_metadata", headers=secret, timeout=T)
    assert meta.status_code == 200 and json.loads(meta.content)["engine_id"] == cluster.exposed.name
    assert httpx.get(f"{base}/health", timeout=T).status_code == 200  # probes and scrapers need no secret
    assert httpx.get(f"{base}/metrics", timeout=T).status_code == 200


def test_worker_bodies_are_capped(cluster):
    secret = {"x-pdserve-cluster-secret": SECRET, "content-type": "application/json"}
    resp = httpx.post(f"{cluster.prefill.url}/internal/generate", content=b" " * (33 << 20), headers=secret, timeout=T)
    assert _is_error(resp, 413)["code"] == "request_too_large"
    assert httpx.get(f"{cluster.prefill.url}/health", timeout=T).status_code == 200


# -- NIXL metadata only from configured peers --


def test_decode_reads_kv_only_from_configured_peers(cluster):
    resp = httpx.post(f"{cluster.stranger.url}/v1/completions", json=GOOD, timeout=T)
    assert 500 <= resp.status_code < 600 and resp.status_code != 500, resp.text  # an upstream failure, not a crash
    assert "not from a configured peer" in resp.json()["error"]["message"]
    assert _counter(cluster.decode, "pdserve_kv_transfer_failures_total") >= 1
    ok = httpx.post(f"{cluster.keyed.url}/v1/completions", json=GOOD, headers=AUTH, timeout=T)
    assert ok.status_code == 200  # the configured pair still works


def _counter(proc, name: str) -> float:
    deadline = time.monotonic() + 10  # the worker exports its transfer stats from its step loop
    while True:
        text = httpx.get(f"{proc.url}/metrics", timeout=T).text
        value = next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_a_decode_worker_needs_peers(cluster):
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        "--role",
        "decode",
        "--port",
        str(free_port()),
        "--model",
        str(cluster.model),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--peer" in proc.stderr


# -- nothing from the network is unpickled or evaluated --

UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle", "joblib"}


def _unsafe(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                name = f"{f.value.id}.{f.attr}"
                if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "np.load", "numpy.load"):
                    found.append(name)
                if name == "torch.load" and not any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords
                ):
                    found.append("torch.load without weights_only=True")
    return found


def test_no_code_path_unpickles_or_evaluates():
    files = sorted((ROOT / "pdserve").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    assert len(files) > 20
    bad = {str(f.relative_to(ROOT)): hits for f in files if (hits := _unsafe(ast.parse(f.read_text(), str(f))))}
    assert bad == {}
    # the scanner itself finds what it looks for
    assert _unsafe(ast.parse("import pickle\nyaml.load(x)\neval(s)\ntorch.load(p)")) == [
        "pickle",
        "yaml.load",
        "eval()",
        "torch.load without weights_only=True",
    ]
