"""Structured outputs with speculative decoding (tiny DeepSeek-V3 with its tokenizer, float32):
drafts the grammar refuses are cut before verify, each verify position is masked by the
grammar's state after the drafts before it, and the matcher advances only by emitted tokens. The
oracle is the same engine without speculation: greedy requests under a JSON schema, a regex, a
and a choice give exactly its tokens with n-gram drafts and with drafts forced right (the
constrained greedy tokens themselves); answers that stop are valid. Drafts always wrong are
test_spec_decode.py's (no grammar involved); here the cut itself is checked on the matcher."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.structured import compiler_for
from pdserve.structured.matcher import RequestMatcher
from pdserve.tiny_model import make_tiny_model
from tests.unit.test_spec_decode import Oracle

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
SPECS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": ["alpha beta", "alpha gamma"]}]
PROMPTS = ["a a a a", "one two one two one two"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_spec_grammar"), "deepseek_v3", seed=0))


def _llm(tiny: str, k: int) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLM(tiny, dtype="float32", kv_block_size=8, num_kv_blocks=256, speculative_config=spec)


def _params() -> list[SamplingParams]:
    so = [StructuredOutputsParams(**s) for s in SPECS]
    return [SamplingParams(temperature=0, max_tokens=16, structured_outputs=s) for s in so]


@pytest.fixture(scope="module")
def spec_llm(tiny):
    return _llm(tiny, 3)


@pytest.fixture(scope="module")
def plain(spec_llm):
    """The oracle: the same engine with its speculation off."""
    engine = spec_llm.engine
    prompts = [f"{p} ({j})" for p in PROMPTS for j in range(len(SPECS))]  # distinct: the oracle's keys
    params = [p for _ in PROMPTS for p in _params()]
    spec, engine.spec = engine.spec, None
    outs = spec_llm.generate(prompts, params)
    engine.spec = spec
    return spec_llm, prompts, params, outs


def _assert_valid(outs) -> None:
    for i, o in enumerate(outs):
        spec = SPECS[i % len(SPECS)]
        if o.finish_reason != "stop":
            continue
        if "json" in spec:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif "regex" in spec:
            assert re.fullmatch(REGEX, o.text), o.text
        else:
            assert o.text in spec["choice"]


@pytest.mark.parametrize("proposer", ["ngram", "right"])
def test_grammar_requests_with_drafts_give_the_tokens_without(spec_llm, plain, proposer):
    _, prompts, params, plain_outs = plain
    expected = [o.outputs[0] for o in plain_outs]
    llm, engine = spec_llm, spec_llm.engine
    engine.spec.stats = SpecDecodeStats(3)
    if proposer == "right":
        ids = [o.prompt_token_ids for o in plain_outs]
        engine.spec.proposer = Oracle(ids, [o.token_ids for o in expected], engine.runner.model.config.vocab_size)
    step, cut = LLMEngine.step.__get__(engine), []

    def checked():  # every draft that reaches verify is one the grammar allows from its state
        out = step()
        for seq in engine.scheduler.running:
            if seq.spec_token_ids and seq.grammar is not None:
                cut.append(seq.grammar.num_allowed(seq.spec_token_ids) == len(seq.spec_token_ids))
        return out

    engine.step = checked
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(cut) and cut
    s = engine.spec.stats
    assert s.num_drafts > 0
    if proposer == "right":
        assert s.num_accepted_tokens == s.num_draft_tokens
    assert any(o.finish_reason == "stop" for o in outs)
    _assert_valid(outs)
    assert engine.get_stats().kv_blocks_used == 0


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(plain):
    llm = plain[0]
    tok = llm.get_tokenizer()
    compiler = compiler_for(tok, llm.engine.runner.model.config.vocab_size, sorted(llm.engine.eos_token_ids))
    spec = StructuredOutputsParams(regex=REGEX)
    m = RequestMatcher(compiler.compile(spec), spec)
    good, bad = tok.encode("abc-12", False), tok.encode("x", False)
    assert m.num_allowed(good + bad + good) == len(good) and m.num_allowed(bad + good) == 0
    ahead = m.ahead(good[:2])
    assert ahead.num_allowed(good[2:] + bad) == len(good) - 2
    assert m.num_allowed(good) == len(good)  # the request's own state is unchanged
    for t in good:
        assert m.advance(t)
    assert m.num_allowed(bad) == 0
    # a grammar that starts after a token: free text (any draft) up to it, then constrained
    free = tok.encode("hello there", False)
    trigger = free[-1]
    later = StructuredOutputsParams(regex=REGEX, start_after_token_id=trigger)
    m = RequestMatcher(compiler.compile(later), later)
    assert m.num_allowed(free + good + bad) == len(free) + len(good)
    assert m.num_allowed(free[:-1] + bad) == len(free) - 1 + len(bad)
