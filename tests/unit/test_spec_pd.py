"""Speculative decoding on a PD decode engine (in-process FakeConnector, tiny V3 and V3.2 in
float32): the decode engine takes the prompt's KV from a prefill engine and then verifies n-gram
drafts, or drafts forced right / always wrong, from its first step (the prompt and the first
token are all they need); its greedy tokens equal a colocated engine's without speculation, and
both sides end with 0 blocks used."""

from __future__ import annotations

import pytest

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.sampling_params import SamplingParams
from pdserve.tiny_model import make_tiny_model
from tests.unit.test_spec_decode import MAX_TOKENS, Oracle, _prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def tiny(request, tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def engine(tiny: str, connector=None, **kw) -> LLMEngine:
    cfg = dict(model=tiny, dtype="float32", kv_block_size=4, num_kv_blocks=96, skip_tokenizer_init=True)
    return LLMEngine(EngineConfig(**{**cfg, **kw, "max_num_batched_tokens": 16}), connector)


def generate(eng: LLMEngine, reqs: list[Request]) -> dict[str, list[int]]:
    for r in reqs:
        eng.add_request(r)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o
    return out


def requests(prompts, **kw) -> list[Request]:
    return [
        Request(request_id=str(i), prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), **kw)
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))
    ]  # fmt: skip


def drafted_from_the_first_step(max_tokens: int, k: int) -> int:
    """Draft tokens a request verifies when every decode step, its first here included, drafts as
    many as could all be emitted (min(k, tokens left - 1)) and accepts them all."""
    left, drafts = max_tokens - 1, 0  # the first token came from prefill
    while left > 0:
        d = min(k, left - 1)
        drafts, left = drafts + d, left - d - 1
    return drafts


@pytest.mark.parametrize("proposer", ["ngram", "right", "wrong"])
def test_decode_engine_speculates_after_the_handoff(tiny, proposer):
    prompts = _prompts(0)
    colocated = {k: v.outputs[0].token_ids for k, v in generate(engine(tiny), requests(prompts)).items()}
    fabric = FakeFabric()
    pre_conn, dec_conn = (FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D"))
    prefill = engine(tiny, pre_conn)
    firsts = generate(prefill, requests(prompts, hold_kv=True))
    decode = engine(tiny, dec_conn, speculative_config=SPEC)
    if proposer != "ngram":
        expected = [colocated[str(i)] for i in range(len(prompts))]
        decode.spec.proposer = Oracle(prompts, expected, decode.runner.model.config.vocab_size, proposer == "right")
    handoff = [
        r.model_copy(update={"kv_handle": firsts[r.request_id].kv_handle,
                             "first_token": FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0])})
        for r in requests(prompts)
    ]  # fmt: skip
    final = generate(decode, handoff)
    assert {k: v.outputs[0].token_ids for k, v in final.items()} == colocated
    s = decode.spec.stats
    assert s.num_drafts > 0
    if proposer == "right":  # every decode step, the first included, verifies drafts and emits k + 1 tokens
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert s.num_draft_tokens == sum(
            drafted_from_the_first_step(n, SPEC["num_speculative_tokens"]) for n in MAX_TOKENS
        )
    if proposer == "wrong":
        assert s.num_accepted_tokens == 0
    for _ in range(3):  # the prefill side frees its held blocks once decode's release arrives
        prefill.step()
    assert decode.get_stats().kv_blocks_used == 0 and prefill.get_stats().kv_blocks_used == 0


def test_drafts_without_room_in_the_pool_are_dropped_not_waited_for(tiny):
    """Two handed-off requests fill the decode pool (15 tokens each in 4 blocks of 4): their
    first-step drafts would need a fifth block each, so they decode one token instead of waiting
    for room that only they could free; then preemption makes room as usual. Tokens as colocated."""
    prompts = [list(range(20, 34)), list(range(40, 54))]  # 14 tokens + the first = 15
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = [Request(request_id=str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    colocated = {k: v.outputs[0].token_ids for k, v in generate(engine(tiny), reqs).items()}
    fabric = FakeFabric()
    pre_conn, dec_conn = (FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D"))
    prefill = engine(tiny, pre_conn)
    firsts = generate(prefill, [r.model_copy(update={"hold_kv": True}) for r in reqs])
    decode = engine(tiny, dec_conn, speculative_config=SPEC, num_kv_blocks=8)
    expected = [colocated[str(i)] for i in range(len(prompts))]
    decode.spec.proposer = Oracle(prompts, expected, decode.runner.model.config.vocab_size)
    for r in reqs:
        first = FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0])
        decode.add_request(r.model_copy(update={"kv_handle": firsts[r.request_id].kv_handle, "first_token": first}))
    final = {}
    for _ in range(200):  # a stall (both waiting for blocks they hold) would never finish
        for o in decode.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
        if not decode.has_unfinished_requests():
            break
    assert final == colocated
    assert decode.spec.stats.num_accepted_tokens > 0 and decode.get_stats().kv_blocks_used == 0
