"""DeepSeek-V4 through PD on CPU: real prefill and decode workers, real NIXL (UCX) reads of every V4
cache region (window, CSA / HCA entries, indexer keys, compressor state), a router, the OpenAI API.

- greedy tokens through the router equal the offline engine's (`LLM`), for 8 concurrent prompts
  whose lengths straddle the tiny model's rates (4, 16) and window (8), finishing at different
  times, with the decode worker speculating (n-gram drafts, k = 3: rejected drafts leave its
  window, entries and compressor state as they were); afterwards no block is in use on either
  worker and every lease ended by decode's release
- the same through a second pair drafting with the MTP layer on both workers (k = 2: its window
  records travel with the other layers', the residual streams of the prompt's last position in
  the hand-off), the decode worker drafting from its first step
- `pdserve launch --model tiny:deepseek_v4` (router + prefill + decode, no speculation) serves the
  same tokens
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, free_port, scrape, wait_blocks_free

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(10, 10 + n)) for n in (3, 7, 8, 9, 15, 16, 17, 33)]
MAX_TOKENS = [18, 5, 12, 9, 16, 7, 14, 10]
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("v4_e2e") / "tiny", arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(model=str(tiny), dtype="float32", kv_block_size=16, num_kv_blocks=128, skip_tokenizer_init=True)
    outs = [llm.generate(prompt_token_ids=p, sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(PROMPTS, MAX_TOKENS)]  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def _complete(url: str, prompt: list[int], n: int) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _concurrently(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda pn: _complete(url, *pn), zip(PROMPTS, MAX_TOKENS)))


def test_pd_cluster_equals_offline_engine(tiny, offline, tmp_path):
    with Cluster(tiny, tmp_path / "logs", kv_blocks=128) as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", "--speculative-config", SPEC, peers=[prefill])
        router = c.router(prefill=[prefill], decode=[decode])
        mtp = [c.worker("prefill", "--kv-block-size", "16", "--speculative-config", MTP)]
        mtp.append(c.worker("decode", "--kv-block-size", "16", "--speculative-config", MTP, peers=mtp))
        mtp_router = c.router(prefill=mtp[:1], decode=mtp[1:])
        c.wait_healthy()
        assert _concurrently(router.url) == offline
        assert _concurrently(mtp_router.url) == offline
        everyone = [prefill, decode, *mtp]
        assert wait_blocks_free(everyone) == {w.name: 0 for w in everyone}
        for pre, dec in ((prefill, decode), mtp):
            d, p = scrape(dec.url), scrape(pre.url)
            assert d["pdserve_kv_transfer_bytes_total"] > 0 and d["pdserve_kv_transfer_seconds_count"] == len(PROMPTS)
            assert p["pdserve_kv_lease_expirations_total"] == 0
            assert d["pdserve_spec_decode_num_drafts_total"] > 0


def test_launch_tiny_v4_serves_the_offline_tokens(tiny, offline, tmp_path):
    ports = [free_port() for _ in range(3)]
    worker = {"numa_node": None, "kv_block_size": 16, "num_kv_blocks": 128, "max_num_seqs": 8}
    cfg = {
        "model": "tiny:deepseek_v3",  # --model below overrides it
        "served_model_name": "tiny",
        "router": {"port": ports[0], "health_interval": 0.5},
        "prefill": [{**worker, "port": ports[1]}],
        "decode": [{**worker, "port": ports[2]}],
        "log_dir": str(tmp_path / "logs"),
        "startup_timeout": 240,
        "stop_grace_seconds": 5,
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    # launch makes the tiny model in an empty cache: the same files as `tiny`'s (arch and seed 0 fix them)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "launch.out"
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "launch",
        "--config",
        str(tmp_path / "cluster.yaml"),
        "--model",
        "tiny:deepseek_v4",
    ]
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 270
        while "pdserve is up" not in out.read_text():
            assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{out.read_text()}"
            assert time.monotonic() < deadline, f"launcher not up:\n{out.read_text()}"
            time.sleep(0.5)
        assert _concurrently(f"http://127.0.0.1:{ports[0]}") == offline
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
