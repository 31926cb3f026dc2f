"""Speculative decoding through the engine (pdserve/engine/spec_decode/), tiny V3 and V3.2 in float32.

The oracle is the same engine without speculation (itself checked against transformers in
test_llm_parity.py): greedy with drafts must give the same tokens, token for token, with chunked
prefill (a 16-token step budget, which also truncates drafts), preemption under a small KV pool,
and aborts, leaving 0 blocks used. Besides n-gram drafts (prompts that repeat themselves, so
lookups hit), two test proposers fix the acceptance: one proposes the target's own greedy tokens
(every verify step must emit k + 1 tokens), one always proposes a wrong token (every step emits 1).
Verify chunks run as decode rows (ForwardBatch.build's as_decode_rows), eagerly and replayed
through CudaGraphRunner (its replay run eagerly here), with the tokens of the chunk path.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.cuda_graphs import CudaGraphRunner
from pdserve.engine.sequence import Sequence
from pdserve.model.batch import ForwardBatch
from pdserve.model.kv_cache import KVCache
from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = (14, 5, 9, 12)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(vocab: int) -> list[list[int]]:
    motif = [7, 21, 33, 42, 5]
    return [motif * 3, [9, 8, 7] * 5 + [1], list(range(10, 40)), [50, 51] * 9]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def model(request, tmp_path_factory):
    path = str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))
    llm = _llm(path)
    prompts = _prompts(llm.engine.runner.model.config.vocab_size)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    return path, prompts, [o.outputs[0].token_ids for o in outs]


def _llm(path: str, spec: dict | None = None, **kw) -> LLM:
    args = dict(dtype="float32", kv_block_size=4, max_num_batched_tokens=16, skip_tokenizer_init=True)
    return LLM(path, **{**args, **kw}, **({"speculative_config": spec} if spec else {}))


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


class Oracle:
    """Test proposer: the target's own greedy continuation (right), or always a wrong token."""

    drafts_from_tokens = True  # as n-gram: it may draft before a PD decode request's first step

    def __init__(self, prompts, expected, vocab: int, right: bool = True) -> None:
        self.expected = {tuple(p): e for p, e in zip(prompts, expected)}
        self.vocab, self.right = vocab, right

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        n = seq.num_output_tokens
        nxt = self.expected[tuple(seq.prompt_token_ids)][n : n + limit]
        return nxt if self.right else [(t + 1) % self.vocab for t in nxt]


def _oracle_llm(path, prompts, expected, k: int, right: bool = True, **kw) -> LLM:
    llm = _llm(path, {"method": "ngram", "num_speculative_tokens": k}, **kw)
    llm.engine.spec.proposer = Oracle(prompts, expected, llm.engine.runner.model.config.vocab_size, right)
    return llm


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ngram_greedy_equals_plain_decoding(model, k):
    path, prompts, expected = model
    llm = _llm(path, {**NGRAM, "num_speculative_tokens": k})
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert llm.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_always_right_emits_k_plus_1_tokens_a_step(model, k):
    path, prompts, expected = model
    llm = _oracle_llm(path, prompts, expected, k, max_num_batched_tokens=64)
    i = 0  # one request alone: count its steps
    engine, steps, emitted = llm.engine, 0, []
    llm.engine.add_request(_request("a", prompts[i], _params()[i]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            emitted.append(len(out.outputs[0].token_ids))
        steps += 1
    assert emitted[-1] == MAX_TOKENS[i] and llm.engine.spec.stats.num_accepted_tokens > 0
    gains = [b - a for a, b in zip(emitted, emitted[1:])]
    # the prefill's token, then k + 1 a step until max_tokens caps the drafts
    assert gains == [k + 1] * ((MAX_TOKENS[i] - 1) // (k + 1)) + (
        [(MAX_TOKENS[i] - 1) % (k + 1)] if (MAX_TOKENS[i] - 1) % (k + 1) else []
    )
    s = llm.engine.spec.stats
    assert s.num_accepted_tokens == s.num_draft_tokens
    (out,) = llm.generate(prompt_token_ids=[prompts[i]], sampling_params=_params()[i])
    assert out.outputs[0].token_ids == expected[i]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.get_stats().kv_blocks_used == 0


def _request(rid, prompt, params):
    from pdserve.engine.request import Request

    return Request(request_id=rid, prompt_token_ids=prompt, params=params)


def test_a_draft_always_wrong_emits_1_token_a_step(model):
    path, prompts, expected = model
    llm = _oracle_llm(path, prompts, expected, 3, right=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.spec.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens == 0 and s.mean_accepted_length == 1.0
    assert llm.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("right", [True, False])
def test_preemption_in_the_middle_of_speculation(model, right):
    path, prompts, expected = model
    llm = _oracle_llm(path, prompts, expected, 3, right=right, num_kv_blocks=14)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0


def test_abort_while_drafts_wait(model):
    path, prompts, expected = model
    llm = _oracle_llm(path, prompts, expected, 2)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(_request(str(i), p, _params()[i]))
    done = {}
    while not any(s.spec_token_ids for s in engine.scheduler.running):
        for out in engine.step():
            done[out.request_id] = out
    victim = next(s for s in engine.scheduler.running if s.spec_token_ids).request_id
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done[victim].outputs[0].finish_reason == "abort"
    for i in range(len(prompts)):
        if str(i) != victim:
            assert done[str(i)].outputs[0].token_ids == expected[i]
    assert engine.get_stats().kv_blocks_used == 0


def test_a_seeded_request_with_drafts_depends_on_its_seed_alone(model):
    """A seeded random request drafts and draws from its own generators: alone, again, or in a
    batch of other (drafting) requests, it gets the same tokens."""
    path, prompts, expected = model
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=12, ignore_eos=True)
    runs = []
    for batch in (False, True):
        llm = _oracle_llm(path, prompts, expected, 3)
        if batch:
            outs = llm.generate(
                prompt_token_ids=prompts[::-1] + [prompts[0]], sampling_params=_params()[::-1] + [seeded]
            )
            runs.append(outs[-1].outputs[0].token_ids)
        else:
            for _ in range(2):
                (out,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=seeded)
                runs.append(out.outputs[0].token_ids)
            assert llm.engine.spec.stats.num_drafts > 0
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12


def test_random_sampling_with_drafts_runs_and_frees_everything(model):
    path, prompts, expected = model
    llm = _oracle_llm(path, prompts, expected, 3)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    vocab = llm.engine.runner.model.config.vocab_size
    assert all(len(o.outputs[0].token_ids) == 12 and all(0 <= t < vocab for t in o.outputs[0].token_ids) for o in outs)
    assert llm.engine.spec.stats.num_drafts > 0
    assert llm.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_of_accepted_drafts_are_those_of_plain_decoding(model, mode):
    path, prompts, expected = model
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0], ignore_eos=True, logprobs=3)
    (plain,) = _llm(path, logprobs_mode=mode).generate(prompt_token_ids=[prompts[0]], sampling_params=params)
    llm = _oracle_llm(path, prompts, expected, 3, logprobs_mode=mode)
    (spec,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params)
    s = llm.engine.spec.stats
    assert s.num_accepted_tokens == s.num_draft_tokens > 0
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids == expected[0]
    assert len(spec.outputs[0].logprobs) == MAX_TOKENS[0]
    for a, b in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert [(x.logprob, x.rank) for x in a.values()] == [
            (pytest.approx(y.logprob, abs=1e-4), y.rank) for y in b.values()
        ]
    assert spec.outputs[0].cumulative_logprob == pytest.approx(plain.outputs[0].cumulative_logprob, abs=1e-3)


def test_penalties_and_min_tokens_count_the_drafts_before_each_position(model):
    """Repetition / frequency / presence penalties and min_tokens depend on the outputs so far:
    each verify position is processed with the drafts before it counted as outputs, so greedy
    tokens equal plain decoding's (drafts forced right, always wrong, and n-gram)."""
    path, prompts, expected = model
    params = [
        SamplingParams(temperature=0, max_tokens=n, repetition_penalty=1.4, frequency_penalty=0.6,
                       presence_penalty=0.4, ignore_eos=True)
        for n in MAX_TOKENS
    ]  # fmt: skip
    plain = [o.outputs[0].token_ids for o in _llm(path).generate(prompt_token_ids=prompts, sampling_params=params)]
    # min_tokens holds back a stop token plain greedy decoding emits third
    held = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[expected[0][2]])
    (held_plain,) = _llm(path).generate(prompt_token_ids=[prompts[0]], sampling_params=held)
    assert len(held_plain.outputs[0].token_ids) >= 6 and held_plain.outputs[0].token_ids[2] != expected[0][2]
    for right in (True, False):
        llm = _oracle_llm(path, prompts, plain, 3, right=right)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.outputs[0].token_ids for o in outs] == plain
        s = llm.engine.spec.stats
        assert s.num_drafts > 0 and (s.num_accepted_tokens > 0) == right
        vocab = llm.engine.runner.model.config.vocab_size
        llm.engine.spec.proposer = Oracle([prompts[0]], [held_plain.outputs[0].token_ids], vocab, right)
        (got,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=held)
        assert got.outputs[0].token_ids == held_plain.outputs[0].token_ids
    llm = _llm(path, NGRAM)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == plain
    assert llm.engine.get_stats().kv_blocks_used == 0


def cpu_graphs(llm, k: int, max_bs: int = 4) -> list[tuple[int, int, int]]:
    """The engine's runner given a CudaGraphRunner whose replay runs the static batch eagerly, over
    a pool with the scratch block; returns (chunks B, rows T, graph rows G) of each replay."""
    r = llm.engine.runner
    n = r.num_kv_blocks
    r.kv_cache = KVCache(r.model.kv_cache_specs(), r.model.num_layers, n + 1, r.block_size, r.dtype, r.device)
    graphs = CudaGraphRunner(r.model, r.kv_cache, max_bs=max_bs, max_len=r.max_model_len, scratch_block=n,
                             max_chunk=k + 1, max_rows=llm.engine.config.max_num_batched_tokens)  # fmt: skip
    replays, fill = [], graphs.fill

    def filled(step):
        key = fill(step)
        replays.append((step.lens.numel(), step.input_ids.numel(), key[0]))
        return key

    def replay(key):
        graphs.outputs[key] = r.model.forward(graphs.static_batch(*key), r.kv_cache)

    graphs.fill, graphs.replay, r.graphs = filled, replay, graphs
    return replays


def test_replayed_verify_rows_give_plain_decodings_tokens(model):
    """Verify steps replayed as decode rows (on CPU, each replay the static padded batch run
    eagerly: capture needs a GPU; scripts/gpu_graphs_check.py compares graphs with eager there)."""
    path, prompts, expected = model
    k = 3
    llm = _oracle_llm(path, prompts, expected, k, max_model_len=64, max_num_batched_tokens=64)
    replays = cpu_graphs(llm, k)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.spec.stats
    assert s.num_accepted_tokens == s.num_draft_tokens > 0
    sizes = llm.engine.runner.graphs.sizes
    assert any(T > B for B, T, _ in replays)  # verify steps replayed: a chunk's tokens as rows
    assert all(T <= G and G in sizes for _, T, G in replays)
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_eager_decode_rows_and_the_chunk_path_give_the_same_tokens(model, monkeypatch):
    """Eager verify steps take the graphs' decode-row metadata (no prefill chunks); with it turned
    off (max_chunk 1) they run as chunks: the same tokens, both plain decoding's."""
    path, prompts, expected = model
    built = []
    build = ForwardBatch.build.__func__

    def spy(cls, step, block_size, as_decode_rows=False):
        built.append((bool((step.lens > 1).any()), as_decode_rows))
        return build(cls, step, block_size, as_decode_rows)

    monkeypatch.setattr(ForwardBatch, "build", classmethod(spy))
    for rows in (True, False):
        llm = _oracle_llm(path, prompts, expected, 2)
        assert llm.engine.runner.max_chunk == 3  # verify chunks of the last token and up to 2 drafts
        if not rows:
            llm.engine.runner.max_chunk = 1
        built.clear()
        outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=_params()[:2])
        assert [o.outputs[0].token_ids for o in outs] == expected[:2]
        assert any(multi and as_rows for multi, as_rows in built) == rows
        assert llm.engine.get_stats().kv_blocks_used == 0
