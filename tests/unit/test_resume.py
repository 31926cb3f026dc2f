"""Request.resume, the router's migration (router/dispatch.py): a request continued on a fresh
engine after k tokens of output gives the uninterrupted run's tokens and text, for every cut k:
greedy, seeded sampling (its draws indexed by output position), a stop string, logprobs after the
cut, text whose characters span tokens (the client's text offset may stop inside the resumed
tokens' text); in the colocated engine and through a PD hand-off (prefill computes prompt +
resumed output and samples the next token, decode continues from it). Nothing is held after.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request, Resume
from pdserve.outputs import RequestOutput, to_entries
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(300)
N = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("resume_v3"), arch="deepseek_v3", seed=0)


def engine(tiny, connector=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny), dtype="float32", kv_block_size=4, num_kv_blocks=256), connector)


def run(eng: LLMEngine, req: Request) -> RequestOutput:
    """The request's final (cumulative) output."""
    eng.add_request(req)
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.request_id == req.request_id), final)
    return final


def whole(eng: LLMEngine, prompt: list[int], params: SamplingParams, rid: str, **kw) -> tuple[list[int], str, list]:
    """A DELTA run reassembled: (tokens, text, logprobs), and the text shown after each token."""
    eng.add_request(
        Request(
            request_id=rid,
            prompt_token_ids=prompt,
            params=params.model_copy(update={"output_kind": RequestOutputKind.DELTA}),
            **kw,
        )
    )
    tokens, text, logprobs, shown, finish = [], "", [], [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            comp = out.outputs[0]
            for j, t in enumerate(comp.token_ids):
                tokens.append(t)
                text += comp.text if j == len(comp.token_ids) - 1 else ""
                shown.append(len(text))
            if not comp.token_ids:
                text += comp.text
            logprobs += comp.logprobs or []
            finish = comp.finish_reason
    return tokens, text, logprobs, shown, finish


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(4, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True, min_tokens=N - 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_colocated_continuation_equals_the_uninterrupted_run(tiny, case):
    params, p = CASES[case], prompt(3, 13)
    eng = engine(tiny)
    tokens, text, logprobs, shown, finish = whole(eng, p, params, "whole")
    assert len(tokens) == N and finish == "length"
    for k in range(1, N):
        resume = Resume(token_ids=tokens[:k], text_offset=shown[k - 1])
        t2, x2, lp2, _, f2 = whole(eng, p, params, f"cut{k}", resume=resume)
        assert t2 == tokens and x2 == text and f2 == finish, f"cut after {k} tokens"
        if params.logprobs is not None:
            assert lp2[:k] == [{}] * k  # the client had them; the worker sends what follows
            for a, b in zip(lp2[k:], logprobs[k:]):
                assert sorted(a) == sorted(b) and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    s = eng.get_stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0


def test_a_stop_string_after_the_cut_ends_it_in_the_same_place(tiny):
    p = prompt(5, 9)
    eng = engine(tiny)
    free = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    tokens, text, _, shown, _ = whole(eng, p, free, "free")
    stop = text[shown[14] : shown[14] + 2] or text[-2:]
    params = free.model_copy(update={"stop": [stop]})
    want = whole(eng, p, params, "whole")
    assert want[4] == "stop" and len(want[0]) > 2
    for k in range(1, len(want[0])):
        got = whole(eng, p, params, f"cut{k}", resume=Resume(token_ids=want[0][:k], text_offset=want[3][k - 1]))
        assert (got[0], got[1], got[4]) == (want[0], want[1], want[4]), f"cut after {k} tokens"


def test_pd_continuation_prefills_prompt_and_resumed_output(tiny):
    """Prefill (hold_kv, resume) samples the token after the resumed ones and hands over KV for
    prompt + resumed output; decode (kv_handle, first token, resume) continues: the uninterrupted
    tokens and text; both engines end with nothing held."""
    p, params = prompt(7, 11), CASES["greedy"]
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = engine(tiny, conns[0]), engine(tiny, conns[1])
    tokens, text, _, shown, _ = whole(engine(tiny), p, params, "whole")
    for k in (1, 6, 17):
        resume = Resume(token_ids=tokens[:k], text_offset=shown[k - 1])
        first = run(
            prefill, Request(request_id=f"p{k}", prompt_token_ids=p, params=params, hold_kv=True, resume=resume)
        )
        comp = first.outputs[0]
        assert comp.token_ids == tokens[: k + 1] and first.kv_handle.num_tokens == len(p) + k
        handoff = FirstToken(
            token_id=comp.token_ids[-1], logprobs=to_entries(comp.logprobs[-1]), text_offset=len(comp.text)
        )
        final = run(
            decode,
            Request(
                request_id=f"p{k}",
                prompt_token_ids=p,
                params=params,
                kv_handle=first.kv_handle,
                first_token=handoff,
                resume=resume,
            ),
        )
        assert final.outputs[0].token_ids == tokens and final.outputs[0].text == text, f"cut after {k} tokens"
    prefill.step()  # takes the releases
    for e in (prefill, decode):
        assert e.get_stats().kv_blocks_used == 0 and not e.has_held_kv()


def test_bad_resumed_output_is_refused(tiny):
    eng = engine(tiny)
    with pytest.raises(ValueError, match="resumed token ids must lie in"):
        eng.add_request(Request(request_id="x", prompt_token_ids=[5, 6], resume=Resume(token_ids=[10**9])))
    with pytest.raises(ValueError, match="leave no room under max_model_len"):
        eng.add_request(
            Request(request_id="y", prompt_token_ids=[5, 6], resume=Resume(token_ids=[7] * eng.max_model_len))
        )
    assert not eng.has_unfinished_requests()
