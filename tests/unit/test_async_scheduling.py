"""The overlapped loop (async_scheduling, llm_engine.py) against the serial one, on the CPU: the
same requests, added and aborted at the same step() calls, give the same tokens, text, finish
and stop reasons (logprobs within float noise: the batches differ by the rows a late-read stop
wastes), and both engines end with no block, window block or state slot held. Each case also
checks that steps did overlap (a launch while the step before was unread) where they may, and
did not where a row needs its token on the host first (grammars, penalties, drafts, PD holds).

Tiny V3 (with its tokenizer: stop strings, multi-byte text), V3.2 and V4 (CSA / HCA groups and
the window crossed while decoding), chunked prefill, preemption, prefix hits, max_model_len,
seeded sampling with min_tokens, aborts mid-flight, n-gram drafts and a PD hand-off.
PDSERVE_ASYNC_TEST_DEVICE=cuda runs the same on a GPU (CUDA graphs, pinned copies, events).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.tiny_model import make_tiny_model
from tests.helpers.v4 import NEW_TOKENS, PROMPT_LENS, pd_hand_off

pytestmark = pytest.mark.timeout(300)
DEVICE = os.environ.get("PDSERVE_ASYNC_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("async_v3"), arch="deepseek_v3", seed=0)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("async_v32"), arch="deepseek_v32", seed=0)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("async_v4"), arch="deepseek_v4", seed=0)


def make(model, overlap: bool, **kw) -> LLMEngine:
    cfg = dict(
        model=str(model), dtype="float32", kv_block_size=8, num_kv_blocks=256, async_scheduling=overlap, device=DEVICE
    )
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def count_overlaps(engine: LLMEngine) -> list[int]:
    """[launches, launches while the step before was unread, tokens computed], updated as the
    engine runs."""
    seen = [0, 0, 0]
    launch = engine.runner.launch

    def spy(sched, prev=None):
        seen[0] += 1
        seen[1] += engine._inflight is not None
        seen[2] += sched.num_batched_tokens
        return launch(sched, prev)

    engine.runner.launch = spy
    return seen


Plan = dict[int, list]  # step() call -> what to do before it: Request to add or "abort:<id>"


def drive(engine: LLMEngine, plan: Plan, abort_at: dict[str, int] | None = None) -> dict[str, RequestOutput]:
    """Run to completion: plan's adds and aborts before the numbered step() calls; abort_at aborts
    a request once it has output that many tokens."""
    done: dict[str, RequestOutput] = {}
    abort_at = dict(abort_at or {})
    calls = 0
    while calls <= max(plan, default=0) or engine.has_unfinished_requests():
        for item in plan.get(calls, []):
            engine.add_request(item) if isinstance(item, Request) else engine.abort_request(item)
        for out in engine.step():
            n = abort_at.get(out.request_id)
            if n is not None and len(out.outputs[0].token_ids) >= n and not out.finished:
                engine.abort_request(out.request_id)
                del abort_at[out.request_id]
            if out.finished:
                done[out.request_id] = out
        calls += 1
        assert calls < 5000, "the engine did not finish"
    return done


def assert_no_kv_held(engine: LLMEngine) -> None:
    s = engine.get_stats()
    assert (s.kv_blocks_used, s.kv_window_blocks_used, s.kv_state_slots_used) == (0, 0, 0), s
    assert not engine.has_held_kv()


def assert_same(serial: dict[str, RequestOutput], overlapped: dict[str, RequestOutput]) -> None:
    assert sorted(serial) == sorted(overlapped)
    for rid, a in serial.items():
        x, y = a.outputs[0], overlapped[rid].outputs[0]
        case = f"request {rid}"
        assert x.token_ids == y.token_ids, case
        assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason), case
        assert (x.logprobs is None) == (y.logprobs is None), case
        for lx, ly in zip(x.logprobs or [], y.logprobs or []):
            assert sorted(lx) == sorted(ly), case
            for t in lx:
                assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4), case
                assert (lx[t].rank, lx[t].decoded_token) == (ly[t].rank, ly[t].decoded_token), case


def both(model, plan_of, abort_at=None, **kw) -> tuple[dict, list[int], dict, list[int]]:
    """(serial outputs, serial launches, overlapped outputs, overlapped launches) of the same plan
    (plan_of() builds fresh Requests for each engine); both engines end holding no KV."""
    results = []
    for overlap in (False, True):
        engine = make(model, overlap, **kw)
        seen = count_overlaps(engine)
        results += [drive(engine, plan_of(), abort_at), seen]
        assert_no_kv_held(engine)
    assert_same(results[0], results[2])
    assert results[1][1] == 0, "the serial loop overlapped a step"
    return tuple(results)


def prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (n,), generator=g).tolist() for n in lens]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_block_size=4, max_num_batched_tokens=11),  # chunked prefill beside decodes
        dict(kv_block_size=16, num_kv_blocks=9, max_num_batched_tokens=24),  # preemption
        dict(kv_block_size=8, max_num_batched_tokens=64),
    ],
    ids=["chunked", "preempt", "plain"],
)
def test_v4_greedy_staggered_arrivals(v4, kw):
    ps = prompts(5, PROMPT_LENS)

    def plan() -> Plan:  # half at the start, the rest one every other step
        reqs = [
            Request(request_id=str(i), prompt_token_ids=p, params=greedy(n))
            for i, (p, n) in enumerate(zip(ps, NEW_TOKENS))
        ]
        out: Plan = {0: reqs[:5]}
        for j, r in enumerate(reqs[5:]):
            out.setdefault(2 * j + 1, []).append(r)
        return out

    _, _, _, seen = both(v4, plan, **kw)
    assert seen[1] > seen[0] // 3, seen


def test_v4_prefix_hits_and_checkpoints(v4):
    """Second turns that extend the first turns' prompts and outputs: hits on blocks and on V4's
    prefix checkpoints (window and compressor state), taken while steps overlap."""
    ps = prompts(7, (40, 52, 37))
    first = [Request(request_id=f"a{i}", prompt_token_ids=p, params=greedy(12)) for i, p in enumerate(ps)]
    results = []
    for overlap in (False, True):
        engine = make(v4, overlap, kv_block_size=16)  # a multiple of HCA's rate: blocks reusable
        seen = count_overlaps(engine)
        turn1 = drive(engine, {0: [r.model_copy() for r in first]})
        second = [
            Request(
                request_id=f"b{i}",
                prompt_token_ids=p + turn1[f"a{i}"].outputs[0].token_ids + [9, 10],
                params=greedy(10),
            )
            for i, p in enumerate(ps)
        ]
        turn2 = drive(engine, {0: second})
        assert all(o.num_cached_tokens >= 32 for o in turn2.values()), [o.num_cached_tokens for o in turn2.values()]
        results.append(({**turn1, **turn2}, seen))
        assert_no_kv_held(engine)
    assert_same(results[0][0], results[1][0])
    assert results[1][1][1] > 0


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_v3_and_v32_greedy_with_preemption(arch, v3, v32):
    model = v3 if arch == "v3" else v32
    ps = prompts(11, (5, 17, 30, 9, 44, 23))
    reqs = lambda: {0: [Request(request_id=str(i), prompt_token_ids=p, params=greedy(14)) for i, p in enumerate(ps)]}  # noqa: E731
    _, _, _, seen = both(model, reqs, kv_block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    assert seen[1] > 0


def test_stops_seeds_logprobs_and_min_tokens(v3):
    """Seeded random sampling (its draws indexed by output position, in flight too), min_tokens,
    top logprobs, stop strings and stop token ids cut from a first run's text: a stop read one
    step late wastes the row of the step already launched, and the request ends where the
    serial loop ends it."""
    rng = random.Random(3)
    ps = prompts(13, (6, 11, 19, 27, 8, 14))

    def params(i: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=40, min_tokens=3, logprobs=2, **kw)

    free = make(v3, False)
    texts = drive(
        free, {0: [Request(request_id=str(i), prompt_token_ids=p, params=params(i)) for i, p in enumerate(ps)]}
    )
    cases = []
    for i, p in enumerate(ps):
        out = texts[str(i)].outputs[0]
        text, ids = out.text, out.token_ids
        at = rng.randrange(1, max(2, len(text) - 2))
        kw = (
            dict(stop=[text[at : at + 2]])
            if i % 3 == 0
            else dict(stop_token_ids=[ids[len(ids) // 2]])
            if i % 3 == 1
            else {}
        )
        cases.append(
            Request(request_id=str(i), prompt_token_ids=p, params=params(i, include_stop_str_in_output=i == 3, **kw))
        )
    serial, _, overlapped, seen = both(v3, lambda: {0: [r.model_copy() for r in cases]})
    assert seen[1] > 0
    reasons = {o.outputs[0].finish_reason for o in serial.values()}
    assert "stop" in reasons, reasons


def test_max_model_len_ends_a_request_in_flight(v3):
    """A request that reaches max_model_len or max_tokens is not scheduled past the token that
    ends it, though that token is still in flight: with no stop to read late, the overlapped
    loop computes exactly the serial loop's tokens (no wasted row)."""
    ps = prompts(17, (20, 30, 35))

    def reqs() -> Plan:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, None, None)]
        return {2 * i: [Request(request_id=str(i), prompt_token_ids=p, params=params[i])] for i, p in enumerate(ps)}

    serial, before, _, seen = both(v3, reqs, max_model_len=40)
    assert [len(serial[str(i)].outputs[0].token_ids) for i in range(3)] == [7, 10, 5]
    assert seen[1] > 0 and seen[2] == before[2], (before, seen)


def test_aborts_while_a_step_is_in_flight(v3):
    """Aborted once 1, 4 or 7 tokens are out (the next step's token already in flight: it is
    dropped), and one aborted before it started: same outputs, nothing held. (An abort lands
    between steps: a client that aborts has seen what was output; the overlapped loop outputs a
    step later, so an abort timed by step() calls, not by outputs, may keep one token fewer.)"""
    ps = prompts(19, (9, 14, 22, 6))

    def reqs() -> Plan:
        plain = [Request(request_id=str(i), prompt_token_ids=p, params=greedy(20)) for i, p in enumerate(ps)]
        return {0: plain, 3: [Request(request_id="late", prompt_token_ids=ps[0], params=greedy(5)), "late"]}

    serial, _, _, seen = both(v3, reqs, abort_at={"0": 4, "1": 1, "2": 7})
    for rid, n in (("0", 4), ("1", 1), ("2", 7)):
        assert (serial[rid].outputs[0].finish_reason, len(serial[rid].outputs[0].token_ids)) == ("abort", n)
    assert serial["late"].outputs[0].token_ids == [] and serial["3"].outputs[0].finish_reason == "length"
    assert seen[1] > 0


def test_rows_that_need_their_token_on_the_host_run_serially(v3):
    """A grammar's mask and penalties need the previous token before the next launch: steps with
    such rows do not overlap, and every request still equals the serial loop's."""
    ps = prompts(23, (7, 12, 16))
    choice = {"choice": ["alpha", "beta", "gamma delta"]}
    reqs = lambda: {  # noqa: E731
        0: [
            Request(
                request_id="grammar",
                prompt_token_ids=ps[0],
                params=SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice),
            ),
            Request(
                request_id="penalty",
                prompt_token_ids=ps[1],
                params=SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
            ),
            Request(request_id="plain", prompt_token_ids=ps[2], params=greedy(30)),
        ]
    }
    serial, _, _, seen = both(v3, reqs)
    assert serial["grammar"].outputs[0].text in choice["choice"]
    assert 0 < seen[1] < seen[0]  # "plain" overlaps once it runs alone


def test_ngram_drafts_run_serially(v3):
    ps = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    reqs = lambda: {0: [Request(request_id=str(i), prompt_token_ids=p, params=greedy(16)) for i, p in enumerate(ps)]}  # noqa: E731
    _, _, _, seen = both(v3, reqs, speculative_config=spec)
    assert seen[1] == 0


def test_v4_pd_decode_overlaps_and_equals_serial(v4):
    """Prefill holds (serially: its KV must be whole before the handle goes out); decode loads
    it and decodes overlapped, crossing CSA and HCA groups, equal to a serial decode worker."""
    ps = prompts(29, PROMPT_LENS[:6])
    finals = []
    for overlap in (False, True):
        kw = dict(async_scheduling=overlap, dtype="float32", device=DEVICE)
        final, prefill, decode, _ = pd_hand_off(v4, ps, kw, kw)
        finals.append(final)
        for e in (prefill, decode):
            assert_no_kv_held(e)
    assert_same(finals[0], finals[1])


def test_bench_loop_times_both_loops_and_the_step():
    """benchmarks/engine/bench_loop.py on the CPU: a row per batch with the step alone and both
    loops, and the engine left with nothing held (its requests aborted and drained)."""
    from benchmarks.engine import bench_loop

    report = bench_loop.main(
        ["--model", "tiny-v4", "--batch-sizes", "1,3", "--context", "24", "--steps", "3", "--warmup", "1",
         "--dtype", "float32", "--device", DEVICE]
    )  # fmt: skip
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert r["run_ms"] > 0 and r["serial_ms"] > 0 and r["overlapped_ms"] > 0 and len(r["overlapped_steps_ms"]) == 3
