"""Speculative decoding through `pdserve serve` and the router, with the official openai client:
a colocated worker with n-gram drafts, and a PD pair (NIXL) whose decode worker drafts, answer
greedy completions with the same tokens as a colocated worker without, their /metrics count the
drafts, and no KV block stays used; so do structured-outputs requests (regex, JSON schema), whose
answers are valid; so does a PD pair drafting with MTP (both workers given it). A prefill worker
given n-gram drafts refuses to start, saying why. TP2 verify steps equal TP1, and so do TP2's MTP
drafts (V3 and V4); `pdserve launch --speculative-config` reaches its workers. V4's MTP through PD
over NIXL: tests/e2e/test_v4_pd_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import openai
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, scrape, wait_blocks_free

pytestmark = pytest.mark.timeout(600)

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
MTP = '{"method": "mtp", "num_speculative_tokens": 2}'
PROMPTS = [[7, 21, 33, 42, 5] * 4, [9, 8, 7] * 6, [50, 51] * 10, list(range(10, 50))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_e2e")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.plain = c.worker("colocated")
        c.spec = c.worker("colocated", "--speculative-config", SPEC)
        c.prefill = c.worker("prefill")
        c.decode = c.worker("decode", "--speculative-config", SPEC, peers=[c.prefill])
        c.plain_router = c.router(colocated=[c.plain])
        c.spec_router = c.router(colocated=[c.spec])
        c.pd_router = c.router(prefill=[c.prefill], decode=[c.decode])
        c.mtp_prefill = c.worker("prefill", "--speculative-config", MTP)
        c.mtp_decode = c.worker("decode", "--speculative-config", MTP, peers=[c.mtp_prefill])
        c.mtp_router = c.router(prefill=[c.mtp_prefill], decode=[c.mtp_decode])
        c.wait_healthy()
        yield c


def _tokens(url: str, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return out.choices[0].token_ids


def test_greedy_completions_equal_the_worker_without_speculation(cluster):
    for prompt in PROMPTS:
        assert _tokens(cluster.spec_router.url, prompt) == _tokens(cluster.plain_router.url, prompt)
    m = scrape(cluster.spec.url)
    assert m["pdserve_spec_decode_num_drafts_total"] > 0
    assert m["pdserve_spec_decode_num_draft_tokens_total"] >= m["pdserve_spec_decode_num_drafts_total"]
    assert scrape(cluster.plain.url).get("pdserve_spec_decode_num_drafts_total", 0) == 0
    assert not any(wait_blocks_free([cluster.spec, cluster.plain]).values())


def test_a_prefill_worker_with_speculation_refuses_to_start(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    args = ["--role", "prefill", "--port", "1", "--model", str(model), "--speculative-config", SPEC]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "speculative_config on a prefill worker takes method 'mtp' only" in done.stderr + done.stdout


def test_pd_with_a_speculating_decode_worker_equals_colocated(cluster):
    for prompt in PROMPTS:
        assert _tokens(cluster.pd_router.url, prompt) == _tokens(cluster.plain_router.url, prompt)
    assert scrape(cluster.decode.url)["pdserve_spec_decode_num_drafts_total"] > 0
    assert not any(wait_blocks_free([cluster.prefill, cluster.decode]).values())


def test_pd_with_mtp_on_both_workers_equals_colocated(cluster):
    """MTP through PD over NIXL: the prefill worker's MTP records travel with the other layers'
    and its hidden state in the hand-off; the decode worker drafts from its first step."""
    for prompt in PROMPTS:
        assert _tokens(cluster.mtp_router.url, prompt) == _tokens(cluster.plain_router.url, prompt)
    m = scrape(cluster.mtp_decode.url)
    assert m["pdserve_spec_decode_num_drafts_total"] > 0
    assert scrape(cluster.mtp_prefill.url).get("pdserve_spec_decode_num_drafts_total", 0) == 0
    assert not any(wait_blocks_free([cluster.mtp_prefill, cluster.mtp_decode]).values())


def test_structured_outputs_with_drafts_equal_the_worker_without(cluster):
    client = {
        name: openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for name, r in (("plain", cluster.plain_router), ("spec", cluster.spec_router), ("pd", cluster.pd_router))
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    regex = "[a-c]{2,6}-[0-9]{1,3}"
    for so, valid in (({"regex": regex}, None), ({"json": schema}, schema)):
        got = {}
        for name, c in client.items():
            out = c.completions.create(
                model="tiny", prompt="a b a b a b", max_tokens=24, temperature=0,
                extra_body={"structured_outputs": so, "return_token_ids": True},
            ).choices[0]  # fmt: skip
            got[name] = (out.finish_reason, out.text, out.token_ids)
        assert got["spec"] == got["plain"] == got["pd"]
        finish, text, _ = got["plain"]
        if finish == "stop" and valid is not None:
            jsonschema.validate(json.loads(text), valid)
        elif finish == "stop":
            assert re.fullmatch(regex, text), text
    assert not any(wait_blocks_free([cluster.spec, cluster.plain, cluster.prefill, cluster.decode]).values())


@pytest.mark.usefixtures("restore_torch_threads")
def test_tensor_parallel_verify_steps_equal_tp1(tmp_path):
    """TP2 on CPU (gloo rank processes): a verify chunk is an ordinary chunk to rank 1; greedy
    tokens with n-gram drafts equal TP1's without them."""
    from pdserve import LLM, SamplingParams

    model = str(make_tiny_model(tmp_path / "tiny"))
    engine = dict(
        cpu_threads=1, kv_block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, skip_tokenizer_init=True
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [
        o.outputs[0].token_ids for o in LLM(model, **engine).generate(prompt_token_ids=PROMPTS, sampling_params=params)
    ]
    llm = LLM(model, tensor_parallel_size=2, speculative_config=json.loads(SPEC), **engine)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert got == want and llm.engine.spec.stats.num_drafts > 0
        assert llm.engine.get_stats().kv_blocks_used == 0
    finally:
        llm.engine.shutdown()


def test_launch_takes_the_flag_for_its_workers(tmp_path):
    """`pdserve launch --speculative-config` over a colocated-only cluster: the worker's serve
    file holds it, completions come back, the worker counts drafts."""
    import yaml

    from tests.helpers.launch import free_ports, start_launch, stop_group, wait_up

    ports = free_ports(2)
    config = tmp_path / "colocated.yaml"
    worker = {"port": ports[1], "kv_block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
    config.write_text(yaml.safe_dump({
        "model": "tiny:deepseek_v3", "served_model_name": "tiny", "router": {"port": ports[0], "health_interval": 0.5}, "colocated": [worker],
        "log_dir": str(tmp_path / "logs"), "stop_grace_seconds": 5,
    }))  # fmt: skip
    proc, out = start_launch(config, tmp_path, None, "--speculative-config", SPEC)
    try:
        wait_up(proc, out)
        served = json.loads((tmp_path / "logs" / "colocated-0.json").read_text())
        assert served["worker"]["speculative_config"] == {**json.loads(SPEC)}
        for prompt in PROMPTS:
            assert len(_tokens(f"http://127.0.0.1:{ports[0]}", prompt)) == 24
        assert scrape(f"http://127.0.0.1:{ports[1]}")["pdserve_spec_decode_num_drafts_total"] > 0
    finally:
        stop_group(proc)


@pytest.mark.usefixtures("restore_torch_threads")
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_tensor_parallel_mtp_drafts_and_tokens_equal_tp1(tmp_path, arch):
    """TP2 on CPU (gloo rank processes) with MTP drafts: the MTP layer, sharded as the main
    layers are, runs on both ranks (the MTP command, its input broadcast: V4's residual streams
    [T, N, H]); its drafts equal TP1's, step for step, and the greedy tokens TP1's without
    speculation."""
    from pdserve import LLM, SamplingParams

    model = str(make_tiny_model(tmp_path / "tiny", arch))
    engine = dict(
        cpu_threads=1, kv_block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, skip_tokenizer_init=True
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}

    def run(llm):
        drafts, begin = [], llm.engine.spec.begin if llm.engine.spec else None
        if begin is not None:
            llm.engine.spec.begin = lambda s: (
                drafts.append([x.seq.spec_token_ids[: x.num_spec] for x in s.scheduled]),
                begin(s),
            )
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert llm.engine.get_stats().kv_blocks_used == 0
        return [o.outputs[0].token_ids for o in outs], drafts

    want, _ = run(LLM(model, **engine))
    tp1, drafts1 = run(LLM(model, speculative_config=mtp, **engine))
    llm = LLM(model, tensor_parallel_size=2, speculative_config=mtp, **engine)
    try:
        tp2, drafts2 = run(llm)
    finally:
        llm.engine.shutdown()
    assert tp1 == tp2 == want
    assert drafts2 == drafts1 and any(d for step in drafts1 for d in step)
