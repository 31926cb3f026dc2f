"""Speculative decoding on DeepSeek-V4 (tiny V4 in float32): rejected drafts leave no trace in the
window, the CSA / HCA entries, the indexer keys or the compressors' state (a verify chunk writes
its new state into a spare slot: engine/spec_decode/spare_states.py).

The oracle is the same engine without speculation (itself checked against transformers in
test_v4_engine.py): greedy with drafts must give the same tokens, token for token. The tiny V4
has window 8, CSA rate 4 and HCA rate 16; prompts of 3 to 30 tokens and decodes of up to 13 put
verify chunks across every CSA group boundary, HCA boundaries and the window, a 16-token step
budget chunks the prefills beside verify chunks. Proposers: the target's own tokens with one
wrong at a cycling place (every accepted length 0..k, so the state is kept after some rejections
and recomputed after others), forced right (k + 1 tokens a step), always wrong (1 a step), n-gram.
Also: preemption, aborts, the prefix cache, PD in one process, and the release format (FP4 experts,
FP8 projections) with fp8_ds_v4 KV records.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sequence import Sequence
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 9, 14], [7, 21, 33, 42, 5] * 3, list(range(10, 40)), [50, 51] * 9]
MAX_TOKENS = (13, 6, 9, 11)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(path: str, k: int | None = None, **kw) -> LLM:
    args = dict(dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    spec = {"speculative_config": {**NGRAM, "num_speculative_tokens": k}} if k else {}
    return LLM(path, **{**args, **kw}, **spec)


def _params(max_tokens=MAX_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(make_tiny_model(tmp_path_factory.mktemp("tiny_v4_spec"), "deepseek_v4"))
    outs = _llm(path).generate(prompt_token_ids=PROMPTS, sampling_params=_params())
    return path, [o.outputs[0].token_ids for o in outs]


class Drafts:
    """Test proposer over known greedy continuations: right (the target's own tokens), wrong
    (each one off), or mixed: right but for the draft at j = (drafts so far for this prompt) %
    (k + 1) (j = k: all right). An unknown prompt gets no drafts."""

    def __init__(self, prompts, expected, vocab: int, k: int, mode: str) -> None:
        self.expected = {tuple(p): e for p, e in zip(prompts, expected)}
        self.vocab, self.k, self.mode = vocab, k, mode
        self.calls: dict[tuple, int] = {}

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        n, key = seq.num_output_tokens, tuple(seq.prompt_token_ids)
        nxt = self.expected.get(key, [])[n : n + limit]
        self.calls[key] = self.calls.get(key, -1) + 1
        bad = {"right": -1, "mixed": self.calls[key] % (self.k + 1)}.get(self.mode)
        return [t if bad is not None and i != bad else (t + 1) % self.vocab for i, t in enumerate(nxt)]


def _spec_llm(tiny, k: int, mode: str, prompts=PROMPTS, **kw) -> LLM:
    path, expected = tiny
    llm = _llm(path, k, **kw)
    if mode != "ngram":
        vocab = llm.engine.runner.model.config.vocab_size
        llm.engine.spec.proposer = Drafts(prompts, expected, vocab, k, mode)
    return llm


def _nothing_held(llm: LLM) -> None:
    s = llm.engine.get_stats()
    assert s.kv_blocks_used == s.kv_window_blocks_used == s.kv_state_slots_used == 0


@pytest.mark.parametrize("k,mode", [(1, "mixed"), (2, "mixed"), (3, "mixed"), (3, "ngram")])
def test_greedy_with_drafts_equals_plain_decoding(tiny, k, mode):
    llm = _spec_llm(tiny, k, mode)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == tiny[1]
    stats, spare = llm.engine.spec.stats, llm.engine.spec.spare
    assert stats.num_drafts > 0
    if mode == "mixed":  # every accepted length; rejections both kept the new state and went back
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert spare.num_recomputes > 0 and spare.num_kept > 0
    _nothing_held(llm)


def _alone(llm: LLM, i: int) -> tuple[list[int], list[int]]:
    """Request i run alone: (its tokens, the tokens each step added)."""
    engine, outs = llm.engine, []
    engine.add_request(Request(request_id=f"alone-{i}", prompt_token_ids=PROMPTS[i], params=_params()[i]))
    while engine.has_unfinished_requests():
        outs += [o.outputs[0].token_ids for o in engine.step()]
    return outs[-1], [len(b) - len(a) for a, b in zip(outs, outs[1:])]


@pytest.mark.parametrize("mode", ["right", "wrong"])
def test_drafts_forced_right_or_always_wrong(tiny, mode):
    """Right: k + 1 tokens a step (until max_tokens caps the drafts), no recompute. Wrong: one
    token a step (the verify step's own, then the recompute's). Exact both ways."""
    k, i = 3, 0
    llm = _spec_llm(tiny, k, mode)
    tokens, gains = _alone(llm, i)
    assert tokens == tiny[1][i]
    n = MAX_TOKENS[i] - 1  # after the prefill's token
    if mode == "right":
        assert gains == [k + 1] * (n // (k + 1)) + ([n % (k + 1)] if n % (k + 1) else [])
        assert llm.engine.spec.spare.num_recomputes == 0
    else:
        assert gains == [1] * n and llm.engine.spec.spare.num_recomputes > 0
    s = llm.engine.spec.stats
    assert s.num_accepted_tokens == (s.num_draft_tokens if mode == "right" else 0) and s.num_drafts > 0
    _nothing_held(llm)


def test_preemption_in_the_middle_of_speculation(tiny):
    llm = _spec_llm(tiny, 3, "mixed", num_kv_blocks=14)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == tiny[1]
    assert llm.engine.get_stats().num_preemptions > 0 and llm.engine.spec.stats.num_drafts > 0
    _nothing_held(llm)


def test_abort_while_drafts_wait(tiny):
    llm = _spec_llm(tiny, 2, "mixed")
    engine, done = llm.engine, {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(request_id=str(i), prompt_token_ids=p, params=_params()[i]))
    while not any(s.spec_token_ids for s in engine.scheduler.running):
        done.update({o.request_id: o for o in engine.step()})
    victim = next(s for s in engine.scheduler.running if s.spec_token_ids).request_id
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert done[victim].outputs[0].finish_reason == "abort"
    assert all(done[str(i)].outputs[0].token_ids == tiny[1][i] for i in range(len(PROMPTS)) if str(i) != victim)
    _nothing_held(llm)


def test_a_prefix_written_while_speculating_is_hit_exactly(tiny):
    """With the prefix cache on (blocks of 16, the HCA rate: checkpoints at block ends), a
    speculating request's decode saves a checkpoint at 32 (its computed tokens get there by a verify
    chunk that rejected a draft and kept its new state); a later request whose prompt is that
    prompt and 14 of its output tokens hits it, and its tokens are those the cold engine went on with."""
    path, first = tiny[0], PROMPTS[2][:20]
    greedy = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    (cold,) = _llm(path).generate(prompt_token_ids=[first], sampling_params=greedy)
    out = cold.outputs[0].token_ids
    llm = _spec_llm((path, [out]), 3, "mixed", prompts=[first], kv_block_size=16, enable_prefix_caching=True)
    (warm,) = llm.generate(prompt_token_ids=[first], sampling_params=greedy)
    assert warm.outputs[0].token_ids == out and llm.engine.spec.spare.num_kept > 0
    rest = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (hit,) = llm.generate(prompt_token_ids=[first + out[:14]], sampling_params=rest)
    assert hit.num_cached_tokens == 32  # past the prompt's own checkpoint (16): one a verify step left
    assert hit.outputs[0].token_ids == out[14:18]
    _nothing_held(llm)


def test_a_pd_decode_engine_speculates_exactly(tiny):
    """PD in one process (fake connector): prefill hands over every V4 region (window, entries,
    indexer keys, state); the decode engine verifies mixed drafts; its tokens equal colocated
    plain decoding's and neither side keeps a block or a state slot."""
    from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.request import FirstToken
    from tests.helpers.v4 import run

    path, expected = tiny
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    cfg = dict(model=path, dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    prefill = LLMEngine(EngineConfig(**cfg), conns[0])
    decode = LLMEngine(EngineConfig(**cfg, speculative_config={**NGRAM, "num_speculative_tokens": 3}), conns[1])
    decode.spec.proposer = Drafts(PROMPTS, expected, decode.runner.model.config.vocab_size, 3, "mixed")
    reqs = [Request(request_id=str(i), prompt_token_ids=p, params=_params()[i]) for i, p in enumerate(PROMPTS)]
    firsts = run(prefill, [r.model_copy(update={"hold_kv": True}) for r in reqs])
    handoff = [
        r.model_copy(update={"kv_handle": firsts[r.request_id].kv_handle,
                             "first_token": FirstToken(token_id=firsts[r.request_id].outputs[0].token_ids[0])})
        for r in reqs
    ]  # fmt: skip
    final = run(decode, handoff)
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert decode.spec.stats.num_accepted_tokens > 0 and decode.spec.spare.num_recomputes > 0
    for _ in range(3):  # the prefill side frees its held blocks once decode's release arrives
        prefill.step()
    for eng in (prefill, decode):
        s = eng.get_stats()
        assert s.kv_blocks_used == s.kv_window_blocks_used == s.kv_state_slots_used == 0


def test_the_release_format_with_fp8_kv_records(tiny, tmp_path):
    """The tiny V4 in V4-Flash's formats (FP4 experts, FP8 projections) with fp8_ds_v4 window
    and entry records: greedy with mixed drafts equals the same engine without."""
    from pdserve.tiny_model import quantize_tiny_v4

    quant, _ = quantize_tiny_v4(tiny[0], tmp_path / "quant", tmp_path / "ref", block=(32, 32))
    plain = _llm(str(quant), kv_cache_dtype="fp8").generate(prompt_token_ids=PROMPTS, sampling_params=_params())
    expected = [o.outputs[0].token_ids for o in plain]
    llm = _spec_llm((str(quant), expected), 3, "mixed", kv_cache_dtype="fp8")
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.spec.stats.num_accepted_tokens > 0 and llm.engine.spec.spare.num_recomputes > 0
    _nothing_held(llm)
