"""n > 1 and best_of (engine/forks.py) against the oracle of separate requests: sequence i of a
seeded n > 1 request draws what a lone request seeded seed + i draws (vLLM's per-child seed), so
every forked sequence must give exactly the tokens of a request that computed its whole prompt
itself. That checks what the fork shares and copies (token blocks, a compressor group still open
in a shared block, the sliding window, the compressors' state) on tiny V3, V3.2 and V4; with and
without prefix caching, chunked prefill, the overlapped loop, preemption and under PD (prefill
hands off all but the last prompt token, decode forks). Greedy n = 2 equals n = 1. The prompt is
computed once (plus the last token per sequence), and every block, window block and state slot
is free at the end, aborts included.
"""

from __future__ import annotations

import os

import pytest

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)
SEED = 11
DEVICE = os.environ.get("PDSERVE_FORKS_TEST_DEVICE", "cpu")  # cuda: the same on a GPU (graphs, device copies)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
def tiny(request, tmp_path_factory):
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)


def make(model, connector=None, **kw) -> LLMEngine:
    cfg = dict(
        model=str(model), dtype="float32", kv_block_size=8, num_kv_blocks=256, skip_tokenizer_init=True, device=DEVICE
    )
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def sampled(n: int = 1, seed: int = SEED, max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, n=n, **kw)


def prompt(length: int) -> list[int]:
    return [(i * 7 + 3) % 200 + 5 for i in range(length)]


def run(engine: LLMEngine, reqs: list[Request], abort_after: dict[str, int] | None = None) -> dict:
    """Final outputs by request id; abort_after: request id -> step at which to abort it."""
    for r in reqs:
        engine.add_request(r)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for rid, at in (abort_after or {}).items():
            if step == at:
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


def tokens_by_index(out) -> dict[int, list[int]]:
    return {c.index: c.token_ids for c in out.outputs}


def alone(model, p: list[int], params: list[SamplingParams], **kw) -> dict[int, list[int]]:
    """The tokens of a lone request for each of params, all on one fresh engine of settings kw."""
    reqs = [Request(request_id=str(i), prompt_token_ids=p, params=q) for i, q in enumerate(params)]
    done = run(make(model, **kw), reqs)
    return {i: done[str(i)].outputs[0].token_ids for i in range(len(params))}


def assert_empty(engine: LLMEngine) -> None:
    st = engine.get_stats()
    assert (st.kv_blocks_used, st.kv_window_blocks_used, st.kv_state_slots_used) == (0, 0, 0), st
    assert not engine._groups and not engine._ids


CASES = [  # (prompt length, engine settings): lengths around blocks (8) and V4's groups / window
    (1, {}),
    (9, {}),
    (17, {"enable_prefix_caching": False}),
    (33, {"max_num_batched_tokens": 16}),
    (40, {"async_scheduling": True}),
    (26, {"kv_block_size": 4}),  # V4's HCA rate 8 spans two blocks: a group open in a "full" block
]


@pytest.mark.parametrize("length,kw", CASES, ids=[f"L{n}-{'-'.join(k) or 'default'}" for n, k in CASES])
def test_each_sequence_draws_as_a_lone_seeded_request(tiny, length, kw):
    arch, model = tiny
    engine = make(model, **kw)
    p = prompt(length)
    out = run(engine, [Request(request_id="r", prompt_token_ids=p, params=sampled(n=3))])["r"]
    got = tokens_by_index(out)
    assert sorted(got) == [0, 1, 2]
    want = alone(model, p, [sampled(seed=SEED + i) for i in range(3)], **kw)
    assert got == want, f"{arch} L={length} {kw}"
    assert len({tuple(t) for t in got.values()}) == 3  # three different streams
    assert_empty(engine)


def test_greedy_n_equals_n_1_and_prompt_computed_once(tiny):
    arch, model = tiny
    engine = make(model, enable_prefix_caching=False)
    computed = []
    launch = engine.runner.launch
    engine.runner.launch = lambda sched, prev=None: (
        computed.append(sched.num_batched_tokens) or launch(sched, prev)
    )  # fmt: skip
    p = prompt(30)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = run(engine, [Request(request_id="g", prompt_token_ids=p, params=greedy.model_copy(update={"n": 4}))])["g"]
    lone = alone(model, p, [greedy], enable_prefix_caching=False)[0]
    assert tokens_by_index(out) == {i: lone for i in range(4)}
    # the prompt once, its last token once per sequence, then 11 decode steps of 4 rows
    assert sum(computed) == (len(p) - 1) + 4 + 11 * 4
    assert_empty(engine)


def test_best_of_returns_the_n_most_likely(tiny):
    arch, model = tiny
    engine = make(model)
    p = prompt(21)
    params = sampled(n=2, best_of=5, max_tokens=10)
    out = run(engine, [Request(request_id="b", prompt_token_ids=p, params=params)])["b"]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)  # not asked for
    reqs = [
        Request(request_id=str(i), prompt_token_ids=p, params=sampled(seed=SEED + i, max_tokens=10, logprobs=0))
        for i in range(5)
    ]
    lone = run(make(model), reqs).values()
    best = sorted((o.outputs[0] for o in lone), key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert_empty(engine)


def test_abort_mid_stream_and_preemption_free_everything(tiny):
    arch, model = tiny
    # a pool too small for every sequence at full length: children are preempted and recomputed
    engine = make(model, num_kv_blocks=16, enable_prefix_caching=False)
    p = prompt(20)
    reqs = [
        Request(request_id="kept", prompt_token_ids=p, params=sampled(n=4, max_tokens=16)),
        Request(request_id="cut", prompt_token_ids=prompt(12), params=sampled(n=4, max_tokens=40)),
    ]
    done = run(engine, reqs, abort_after={"cut": 12})
    assert engine.scheduler.num_preemptions > 0
    assert {c.finish_reason for c in done["cut"].outputs} == {"abort"}
    want = alone(model, p, [sampled(seed=SEED + i, max_tokens=16) for i in range(4)])
    assert tokens_by_index(done["kept"]) == want
    assert_empty(engine)


def test_delta_outputs_fold_into_the_final_ones(tiny):
    arch, model = tiny
    engine = make(model)
    p = prompt(13)
    params = sampled(n=3).model_copy(update={"output_kind": RequestOutputKind.DELTA})
    engine.add_request(Request(request_id="d", prompt_token_ids=p, params=params))
    folded = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            folded = out if folded is None else (folded.add(out) or folded)
    assert folded.finished
    want = alone(model, p, [sampled(seed=SEED + i) for i in range(3)])
    assert tokens_by_index(folded) == want
    assert {c.finish_reason for c in folded.outputs} == {"length"}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_pd_prefill_hands_off_before_the_last_token_and_decode_forks(tiny, overlap):
    arch, model = tiny
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = make(model, conns[0], async_scheduling=overlap), make(model, conns[1], async_scheduling=overlap)
    p = prompt(29)
    params = sampled(n=3)
    held = run(prefill, [Request(request_id="r", prompt_token_ids=p, params=params, hold_kv=True)])["r"]
    assert held.outputs[0].token_ids == [] and held.kv_handle.num_tokens == len(p) - 1
    if arch == "deepseek_v4":  # held for decode: only the window blocks of the last W - 1 positions
        (seq,) = prefill.scheduler.held.values()
        n, bs, keep = seq.num_computed_tokens, 8, prefill.runner.model.config.v4.sliding_window - 1
        assert [i for i, b in enumerate(seq.window_table) if b >= 0] == list(range(max(0, n - keep) // bs, -(-n // bs)))
    with pytest.raises(ValueError, match="first_token"):
        Request(request_id="r", prompt_token_ids=p, params=sampled(n=1), kv_handle=held.kv_handle)
    with pytest.raises(ValueError, match="at least 2 tokens"):  # nothing to hand off but the last token
        prefill.add_request(Request(request_id="one", prompt_token_ids=[5], params=params, hold_kv=True))
    out = run(decode, [Request(request_id="r", prompt_token_ids=p, params=params, kv_handle=held.kv_handle)])["r"]
    prefill.step()  # takes the release
    want = alone(model, p, [sampled(seed=SEED + i) for i in range(3)])
    assert tokens_by_index(out) == want
    assert_empty(decode)
    assert prefill.get_stats().kv_blocks_used == 0


def test_llm_generate_gives_n_outputs_a_prompt(tiny):
    from pdserve import LLM

    arch, model = tiny
    llm = LLM(str(model), dtype="float32", device=DEVICE, num_kv_blocks=128)
    prompts = [{"prompt_token_ids": prompt(10)}, {"prompt_token_ids": prompt(23)}]
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))
    ones = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for out, one in zip(outs, ones):
        assert [c.index for c in out.outputs] == [0, 1]
        assert [c.token_ids for c in out.outputs] == [one.outputs[0].token_ids] * 2
    assert_empty(llm.engine)
