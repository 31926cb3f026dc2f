"""Workers on other hosts: a worker bound to every address advertises the address peers reach it
on, in its KV handles' metadata URL; decode reads from it only when that address is an allowed peer.

Two addresses of the loopback range stand for two hosts: prefill binds 0.0.0.0 and advertises
127.0.0.2; decode (on 127.0.0.1) is configured with http://127.0.0.2:<port> as its peer.
"""

from __future__ import annotations

import json
import socket

import httpx

from pdserve.config import WorkerConfig, parse_config
from pdserve.launch import plan
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, wait_blocks_free

H = {"x-pdserve-cluster-secret": SECRET}
PARAMS = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 3, 8, 61]


def test_advertised_address_defaults():
    assert WorkerConfig(port=30000).advertised() == "127.0.0.1"
    assert WorkerConfig(port=30000, host="10.1.2.3").advertised() == "10.1.2.3"
    assert WorkerConfig(port=30000, host="0.0.0.0").advertised() == socket.gethostname()  # never 127.0.0.1 for others
    assert (
        WorkerConfig(port=30000, host="0.0.0.0", advertise_host="10.0.0.7").advertised_url() == "http://10.0.0.7:30000"
    )
    assert WorkerConfig(port=30000, host="::", advertise_host="fd00::7").advertised_url() == "http://[fd00::7]:30000"


def test_launch_gives_decode_the_prefill_advertised_address():
    cfg = parse_config({
        "model": "tiny:deepseek_v3", "cluster_secret": "s",
        "prefill": [{"port": 30000, "host": "0.0.0.0", "advertise_host": "10.0.0.5"}],
        "decode": [{"port": 30001, "host": "0.0.0.0", "advertise_host": "10.0.0.6"}],
    })  # fmt: skip
    prefill, decode, router = plan(cfg, "/models/ckpt")
    assert decode.config.peers == ["http://10.0.0.5:30000"]
    assert router.config.prefill == ["http://10.0.0.5:30000"] and router.config.decode == ["http://10.0.0.6:30001"]


def _generate(url: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}/internal/generate", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def _tokens(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c["token_ids"]]


def test_pd_across_two_addresses(tmp_path):
    with Cluster(make_tiny_model(tmp_path / "tiny"), tmp_path / "logs") as c:
        prefill = c.worker("prefill", "--host", "0.0.0.0", "--advertise-host", "127.0.0.2")
        port = prefill.url.rsplit(":", 1)[1]
        decode = c.worker("decode", "--peer", f"http://127.0.0.2:{port}")
        stranger = c.worker("decode", "--peer", prefill.url)  # the same worker under another address: not allowed
        both = c.worker("colocated")
        router = c.router(prefill=[prefill], decode=[decode])
        c.wait_healthy()

        want = _tokens(_generate(both.url, {"request_id": "ref", "prompt_token_ids": PROMPT, "params": PARAMS}))
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": PROMPT, "return_token_ids": True, **PARAMS})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want

        last = _generate(
            prefill.url, {"request_id": "h", "prompt_token_ids": PROMPT, "params": PARAMS, "hold_kv": True}
        )[-1]
        assert last["kv_handle"]["metadata_url"] == f"http://127.0.0.2:{port}/internal/kv_metadata"
        body = {
            "request_id": "h",
            "prompt_token_ids": PROMPT,
            "params": PARAMS,
            "kv_handle": last["kv_handle"],
            "first_token": {"token_id": last["token_ids"][0]},
        }
        end = _generate(stranger.url, body)[-1]
        assert end["finish_reason"] == "error" and "is not from a configured peer" in end["error"], end
        httpx.post(f"{prefill.url}/internal/abort", json={"request_id": "h"}, headers=H, timeout=10)

        assert wait_blocks_free([prefill, decode, stranger], 10) == {prefill.name: 0, decode.name: 0, stranger.name: 0}
