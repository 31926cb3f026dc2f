"""Structured outputs in the engine, on the tiny DeepSeek-V3 model with random weights: every answer
that finishes with "stop" satisfies its constraint (jsonschema is the oracle for JSON), colocated
and through a prefill -> decode pair (fake connector), with chunked prefill and preemption; the
grammar library's rejections are ValueErrors that name the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.structured import check
from pdserve.tiny_model import make_tiny_model
from tests.helpers.schemas import random_schemas

pytestmark = pytest.mark.timeout(300)

N_SCHEMAS = 100
MAX_TOKENS = 400  # every schema here bounds its answer well below this


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_structured"), "deepseek_v3", seed=0)


def engine(tiny, connector=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny), dtype="float32", kv_block_size=8, num_kv_blocks=1024, max_num_seqs=128)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def run(eng: LLMEngine, requests: list[Request]) -> dict:
    for r in requests:
        eng.add_request(r)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 800, (int(k),), generator=g).tolist() for k in torch.randint(3, 20, (n,), generator=g)]


def sampled(i: int, **so) -> SamplingParams:
    """Seeded sampling: a request's tokens depend on neither its batch nor where it ran."""
    return SamplingParams(
        temperature=1.0, seed=1000 + i, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**so)
    )


def schema_requests(**kw) -> list[Request]:
    schemas = random_schemas(N_SCHEMAS, seed=28)
    return [
        Request(request_id=str(i), prompt_token_ids=p, params=sampled(i, json=s), **kw)
        for i, (p, s) in enumerate(zip(prompts(N_SCHEMAS), schemas))
    ]


def assert_valid(outputs: dict) -> int:
    """Every answer that stopped parses and validates against its schema; returns how many stopped."""
    schemas = random_schemas(N_SCHEMAS, seed=28)
    stopped = 0
    for i, schema in enumerate(schemas):
        out = outputs[str(i)].outputs[0]
        assert out.finish_reason in ("stop", "length"), outputs[str(i)].error
        if out.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(out.text), schema)
    return stopped


@pytest.fixture(scope="module")
def colocated(tiny):
    return run(engine(tiny), schema_requests())


def test_random_schemas_colocated(colocated):
    assert assert_valid(colocated) >= 0.95 * N_SCHEMAS


def test_random_schemas_through_pd(tiny, colocated):
    """Prefill samples the first token under the schema, decode continues the grammar from it: the
    same tokens as colocated (seeded sampling), every answer valid."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = engine(tiny, conns[0]), engine(tiny, conns[1])
    firsts = run(prefill, schema_requests(hold_kv=True))
    handoff = [
        Request(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, params=r.params,
                kv_handle=firsts[r.request_id].kv_handle,
                first_token=FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0]))
        for r in schema_requests() if firsts[r.request_id].kv_handle is not None
    ]  # fmt: skip
    assert len(handoff) == N_SCHEMAS  # no schema's answer is one token long
    final = run(
        decode, [Request.model_validate_json(r.model_dump_json()) for r in handoff]
    )  # as JSON, as the router sends it
    assert {k: v.outputs[0].token_ids for k, v in final.items()} == {
        k: v.outputs[0].token_ids for k, v in colocated.items()
    }
    assert_valid(final)
    prefill.step()
    assert prefill.get_stats().kv_blocks_used == 0 and decode.get_stats().kv_blocks_used == 0


def test_chunked_prefill_and_preemption_keep_the_grammar_in_step(tiny, colocated):
    few = schema_requests()[:24]
    eng = engine(tiny, num_kv_blocks=40, max_num_batched_tokens=16)  # prompts in chunks; too few blocks for all
    out = run(eng, few)
    assert eng.get_stats().num_preemptions > 0
    assert {k: v.outputs[0].token_ids for k, v in out.items()} == {
        r.request_id: colocated[r.request_id].outputs[0].token_ids for r in few
    }


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", kv_block_size=8, num_kv_blocks=512)


def test_regex_choice_and_json_object_offline(llm):
    n = 12
    texts = [f"prompt {i}" for i in range(n)]
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    outs = llm.generate(texts, [sampled(i, regex=regex) for i in range(n)])
    assert all(o.outputs[0].finish_reason == "stop" and re.fullmatch(regex, o.outputs[0].text) for o in outs)
    choices = ["yes", "no", "maybe later"]
    outs = llm.generate(texts, [sampled(i, choice=choices) for i in range(n)])
    assert [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"] == [
        o.outputs[0].text for o in outs
    ]
    assert {o.outputs[0].text for o in outs} <= set(choices) and len({o.outputs[0].text for o in outs}) > 1
    outs = llm.generate(texts, [sampled(i, json_object=True) for i in range(n)])
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(t), dict) for t in stopped)
    grammar = 'start: "v" NUM ("." NUM)?\nNUM: /[0-9]{1,2}/'
    outs = llm.generate(texts, [sampled(i, grammar=grammar) for i in range(n)])
    assert all(re.fullmatch(r"v[0-9]{1,2}(\.[0-9]{1,2})?", o.outputs[0].text) for o in outs)


def test_greedy_choice_ends_with_eos_even_under_min_tokens(llm):
    p = SamplingParams(temperature=0, max_tokens=50, min_tokens=20, structured_outputs={"choice": ["A", "B"]})
    (out,) = llm.generate(["x"], p)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("A", "B")
    assert out.outputs[0].token_ids[-1] in llm.engine.eos_token_ids


def test_start_after_token_leaves_the_text_before_it_free(llm, tiny):
    free = llm.generate(["think first"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    u = free.outputs[0].token_ids
    j = 6
    trigger = u[j]
    j = u.index(trigger)
    p = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs={"choice": ["ALPHA", "BETA"], "start_after_token_id": trigger}
    )
    (out,) = llm.generate(["think first"], p)
    ids = out.outputs[0].token_ids
    assert ids[: j + 1] == u[: j + 1]  # before and up to the token: as without a grammar
    tok = llm.get_tokenizer()
    assert out.outputs[0].finish_reason == "stop" and tok.decode(ids[j + 1 : -1]) in ("ALPHA", "BETA")
    # the trigger as prefill's first token: the decode side turns the grammar on from the hand-off
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = engine(tiny, conns[0]), engine(tiny, conns[1])
    p = p.model_copy(
        update={"structured_outputs": StructuredOutputsParams(choice=["ALPHA", "BETA"], start_after_token_id=u[0])}
    )
    req = Request(request_id="t", prompt_token_ids=tok.encode("think first"), params=p)
    want = run(engine(tiny), [req])["t"].outputs[0].token_ids
    first = run(prefill, [req.model_copy(update={"hold_kv": True})])["t"]
    assert first.outputs[0].token_ids == [u[0]]
    got = run(decode, [req.model_copy(update={"kv_handle": first.kv_handle, "first_token": FirstToken(token_id=u[0])})])
    assert got["t"].outputs[0].token_ids == want and tok.decode(want[1:-1]) in ("ALPHA", "BETA")


@pytest.mark.parametrize(
    "spec,words",
    [
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: foo"}, "foo"),
        ({"json": {"type": "foo"}}, "foo"),
        ({"json": '{"type": "object"'}, "not valid JSON"),
        ({"json": {"type": "string", "pattern": "(x"}}, "x"),
    ],
)
def test_check_names_what_the_library_rejects(llm, spec, words):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=re.escape(words)):
        check(params, llm.get_tokenizer())
    with pytest.raises(ValueError, match=re.escape(words)):  # the engine refuses it too, leaving nothing behind
        llm.engine.add_request(
            Request(request_id="bad", prompt_token_ids=[5, 6], params=SamplingParams(structured_outputs=params))
        )
    assert not llm.engine.has_unfinished_requests()


def test_check_accepts_and_caches(llm):
    tok = llm.get_tokenizer()
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    check(spec, tok)
    check(StructuredOutputsParams(json_schema=json.dumps(spec.json_schema)), tok)  # the same spec, as text
    check(StructuredOutputsParams(choice=["x"]), tok)


def test_structured_outputs_need_a_tokenizer(tiny):
    eng = engine(tiny, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request(
            Request(request_id="a", prompt_token_ids=[5], params=SamplingParams(structured_outputs={"regex": "a"}))
        )


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(tiny):
    plain = [Request(request_id=f"p{i}", prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
             for i, p in enumerate(prompts(4, seed=9))]  # fmt: skip
    alone = run(engine(tiny), plain)
    mixed = run(engine(tiny), plain + schema_requests()[:6])
    assert {r.request_id: mixed[r.request_id].outputs[0].token_ids for r in plain} == {
        k: v.outputs[0].token_ids for k, v in alone.items()
    }


def test_a_handed_off_first_token_the_grammar_refuses_fails_the_request(tiny):
    """A prefill worker that sampled without the constraint: decode finishes the request with an
    error naming structured outputs, never with text outside the grammar."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = engine(tiny, conns[0]), engine(tiny, conns[1])
    req = Request(request_id="r", prompt_token_ids=[5, 6, 7], params=SamplingParams(temperature=0, max_tokens=8))
    first = run(prefill, [req.model_copy(update={"hold_kv": True})])["r"]
    token = first.outputs[0].token_ids[0]
    choice = "<<" if decode.tokenizer.decode([token]) != "<" else ">>"  # a choice its first token cannot begin
    params = req.params.model_copy(update={"structured_outputs": StructuredOutputsParams(choice=[choice])})
    out = run(
        decode,
        [
            req.model_copy(
                update={"params": params, "kv_handle": first.kv_handle, "first_token": FirstToken(token_id=token)}
            )
        ],
    )
    assert out["r"].outputs[0].finish_reason == "error" and "structured outputs" in out["r"].error
    assert decode.get_stats().kv_blocks_used == 0  # nothing loaded (prefill's lease frees its copy)
