"""Outputs per new token (SamplingParams.output_kind) on the tiny model: the delta outputs of every
step fold (RequestOutput.add) into exactly that step's cumulative output, final_only gives the last
one once, a step's work reads only the new end of a sequence (never its whole text), and the PD
fields travel in deltas. The sampled tokens and their logprobs are scripted (the model still runs)
so that multi-byte characters split across byte tokens, EOS and stop strings come when wanted."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pdserve.disagg.fake_connector import FakeConnector, FakeFabric
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FirstToken, Request
from pdserve.engine.sequence import OutputText
from pdserve.outputs import RequestOutput, to_entries
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.tiny_model import make_tiny_model
from pdserve.wire.protocol import GenerateChunk
from pdserve.worker.app import _chunks
from pdserve.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(120)

KINDS = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA, "f": RequestOutputKind.FINAL_ONLY}
TEXT = "Hello wörld! 中文的句子 😀👍🏽 café, the quick brown fox → ∑ naïve Zürich 日本語. "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "deepseek_v3", seed=0)


def make_engine(tiny, connector=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny), kv_block_size=8, max_num_batched_tokens=64, num_kv_blocks=256)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def script(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    """Make the engine sample tokens[base id][k] as output token k (base id: the request id before
    its '-'), with logprobs that depend only on the token and k."""
    launch = engine.runner.launch

    def scripted(sched, prev=None):
        step = launch(sched, prev)
        read = step.read

        def read_scripted(while_busy=None):
            sampled = read(while_busy)
            for s, tok in zip([s for s in sched.scheduled if s.samples], sampled):
                k = s.seq.num_output_tokens
                tok.token_id = tokens[s.seq.request_id.split("-")[0]][k]
                if tok.logprobs is not None:
                    alts = [(4 + (tok.token_id + j) % 800, -2.0 - j, j + 2) for j in range(len(tok.logprobs) - 1)]
                    tok.logprobs = [(tok.token_id, -0.5 - k / 64, 1), *alts]
            return sampled

        step.read = read_scripted
        return step

    engine.runner.launch = scripted


def random_case(rng: random.Random, tok) -> tuple[list[int], SamplingParams]:
    """A token script (text with multi-byte characters split across tokens, EOS now and then) and
    params with stops cut from its text."""
    start = rng.randrange(len(TEXT))
    ids = tok.encode((TEXT * 3)[start:], add_special_tokens=False)
    for _ in range(rng.randrange(3)):
        ids.insert(rng.randrange(len(ids)), tok.eos_token_id)
    text = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.randrange(3)):
        at, n = rng.randrange(len(text)), rng.randrange(1, 5)
        stops.append(text[at : at + n] if rng.random() < 0.8 else "\x00never")
    max_tokens = rng.randrange(1, 60)
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        min_tokens=rng.randrange(min(max_tokens, 6) + 1),
        stop=[s for s in stops if s.strip("\ufffd")],
        include_stop_str_in_output=rng.random() < 0.5,
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 2]),
        skip_special_tokens=rng.random() < 0.8,
    )
    return ids, params


def run_steps(engine: LLMEngine, max_steps: int = 1000) -> list[list[RequestOutput]]:
    steps = []
    while engine.has_unfinished_requests() and len(steps) < max_steps:
        steps.append(engine.step())
    return steps


def fields(out: RequestOutput) -> dict:
    d = out.model_dump()
    d.pop("request_id")
    return d


def fold(deltas: list[RequestOutput]) -> RequestOutput:
    whole = deltas[0].model_copy(deep=True)
    for d in deltas[1:]:
        whole.add(d.model_copy(deep=True))
    return whole


@pytest.mark.parametrize("seed", range(4))
def test_deltas_fold_into_the_cumulative_output_of_every_step(tiny, seed):
    engine = make_engine(tiny, enable_prefix_caching=False)  # the copies of a request: no cache hits
    rng = random.Random(seed)
    cases = {str(i): random_case(rng, engine.tokenizer) for i in range(12)}
    script(engine, {b: ids for b, (ids, _) in cases.items()})
    for b, (_, params) in cases.items():
        prompt = engine.tokenizer.encode(f"Request {b}: tell me")
        for k, kind in KINDS.items():
            p = params.model_copy(update={"output_kind": kind})
            engine.add_request(Request(request_id=f"{b}-{k}", prompt_token_ids=prompt, params=p))
    seen: dict[str, list[RequestOutput]] = {f"{b}-{k}": [] for b in cases for k in KINDS}
    for outs in run_steps(engine):
        for out in outs:
            seen[out.request_id].append(out)
    held_back = 0
    for b in cases:  # the copies may run in other steps (prefill budget): compare output by output
        cum, deltas = seen[f"{b}-c"], seen[f"{b}-d"]
        assert len(cum) == len(deltas)
        whole = deltas[0].model_copy(deep=True)
        for i, (c, d) in enumerate(zip(cum, deltas)):
            if i:
                whole.add(d.model_copy(deep=True))
            assert fields(whole) == fields(c)
            held_back += d.outputs[0].token_ids != [] and d.outputs[0].text == ""
        (final,) = seen[f"{b}-f"]
        assert final.finished and fields(final) == fields(cum[-1])
    assert held_back > 0  # some token's text waited for the rest of its character
    assert engine.get_stats().kv_blocks_used == 0


def test_a_delta_carries_only_the_new_token_and_no_step_reads_the_whole_text(tiny, monkeypatch):
    engine = make_engine(tiny)
    ids = engine.tokenizer.encode(TEXT * 12, add_special_tokens=False)[:400]
    script(engine, {"long": ids})
    stop = ["\x00never", "<<<no>>>"]
    params = SamplingParams(max_tokens=400, ignore_eos=True, logprobs=1, stop=stop, output_kind=RequestOutputKind.DELTA)
    engine.add_request(Request(request_id="long", prompt_token_ids=[5, 6, 7], params=params))
    reads: list[int] = []  # characters each read of the output text walked back over
    slice_ = OutputText.slice

    def counted(self, start, end=None):
        reads.append(len(self) - start)
        return slice_(self, start, end)

    def whole(self):
        raise AssertionError("a step joined the whole output text")

    monkeypatch.setattr(OutputText, "slice", counted)
    monkeypatch.setattr(OutputText, "__str__", whole)
    n = 0
    for outs in run_steps(engine):
        for out in outs:
            c = out.outputs[0]
            assert c.token_ids == ids[n : n + 1] and len(c.logprobs) == 1  # this step's token alone
            n += 1
    assert n == 400
    longest_token = max(len(engine.tokenizer.decode([t])) for t in ids)
    assert max(reads) <= 2 * max(map(len, stop)) + 2 * longest_token  # never the ~1000 characters so far


def test_llm_generate_asks_for_the_final_output_only(tiny):
    from pdserve import LLM

    llm = LLM(str(tiny), kv_block_size=8, num_kv_blocks=128)
    steps: list[list[RequestOutput]] = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(step()) or steps[-1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    (out,) = llm.generate("The quick brown fox", params)
    assert [o.finished for s in steps for o in s] == [True]  # one output, at the end, with everything
    assert len(out.outputs[0].token_ids) == len(out.outputs[0].logprobs) == 12
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as they were


def pd_run(tiny) -> tuple[dict[str, RequestOutput], dict[str, list[RequestOutput]], Request]:
    """Prefill (hold_kv) then decode through the fake connector, one request twice: cumulative ("r-c")
    and deltas ("r-d"). Returns prefill's outputs, decode's outputs by request, the decode request."""
    fabric = FakeFabric()
    conns = [FakeConnector(e, model_id="tiny", fabric=fabric, lease_margin_s=0.0) for e in ("P", "D")]
    prefill, decode = make_engine(tiny, conns[0]), make_engine(tiny, conns[1])
    tok = prefill.tokenizer
    ids = tok.encode("Hello 中文 😀 café " * 4, add_special_tokens=False)
    for engine in (prefill, decode):
        script(engine, {"r": ids})
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=1, stop=["zz", "😀 c"], ignore_eos=True)
    prompt = tok.encode("tell me")
    for k in "cd":
        p = params.model_copy(update={"output_kind": KINDS[k]})
        prefill.add_request(Request(request_id=f"r-{k}", prompt_token_ids=prompt, params=p, hold_kv=True))
    firsts = {o.request_id: o for s in run_steps(prefill) for o in s}
    for k in "cd":
        c = firsts[f"r-{k}"].outputs[0]
        handoff = FirstToken(token_id=c.token_ids[0], logprobs=to_entries(c.logprobs[0]), text_offset=len(c.text))
        p = params.model_copy(update={"output_kind": KINDS[k]})
        req = Request(
            request_id=f"r-{k}",
            prompt_token_ids=prompt,
            params=p,
            kv_handle=firsts[f"r-{k}"].kv_handle,
            first_token=handoff,
        )
        decode.add_request(req)
    seen: dict[str, list[RequestOutput]] = {"r-c": [], "r-d": []}
    for outs in run_steps(decode):
        for out in outs:
            seen[out.request_id].append(out)
    prefill.step()  # takes the releases
    assert prefill.get_stats().kv_blocks_used == 0 and decode.get_stats().kv_blocks_used == 0
    return firsts, seen, req


def test_pd_fields_travel_in_deltas(tiny):
    """The prefill delta has the first token, the visible text and the KV handle; decode's deltas
    start with that token and fold into the cumulative outputs."""
    firsts, seen, _ = pd_run(tiny)
    first = firsts["r-d"]
    assert first.finished and first.kv_handle is not None and len(first.outputs[0].token_ids) == 1
    assert fields(first) | {"kv_handle": None} == fields(firsts["r-c"]) | {"kv_handle": None}
    assert first.outputs[0].text == "Hel"  # "Hello" less the hold-back of a 3-character stop string
    cum, deltas = seen["r-c"], seen["r-d"]
    assert [fields(fold(deltas[: i + 1])) for i in range(len(deltas))] == [fields(c) for c in cum]
    whole = fold(deltas)
    assert whole.outputs[0].token_ids[0] == first.outputs[0].token_ids[0] and whole.prefill_text_offset == 3
    assert whole.outputs[0].text == "Hello 中文 " and whole.outputs[0].stop_reason == "😀 c"
    assert whole.finished and whole.error is None and whole.transfer_error is None


@pytest.mark.parametrize("seed", range(3))
async def test_worker_chunks_from_deltas_equal_those_from_cumulative_outputs(tiny, seed):
    """The decode worker's chunks (app._chunks) from the engine's deltas, some folded as a slow
    reader's stream folds them, equal what the cumulative outputs gave (the code before deltas)."""
    _, seen, req = pd_run(tiny)
    rng = random.Random(seed)
    cum, deltas = seen["r-c"], seen["r-d"]
    cuts = sorted(rng.sample(range(1, len(deltas)), rng.randrange(len(deltas)))) + [len(deltas)]
    read, latest, at = [], [], 0
    for cut in cuts:  # what the reader took at each wake: the deltas since, folded; the latest cumulative
        read.append(fold(deltas[at:cut]))
        latest.append(cum[cut - 1])
        at = cut
    state = SimpleNamespace(metrics=WorkerMetrics())
    got = [c.model_dump(exclude={"request_id"}) async for c in _chunks(state, req, _Stream(read))]
    assert got == [c.model_dump(exclude={"request_id"}) for c in chunks_from_cumulative(latest, req)]
    assert "".join(c["text"] for c in got) == "lo 中文 " and got[0]["token_offset"] == 1


class _Stream:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs, self.timing = outs, None

    async def __aiter__(self):
        for out in self.outs:
            yield out


def chunks_from_cumulative(outs: list[RequestOutput], req: Request) -> list[GenerateChunk]:
    """The worker's chunks as they were made from cumulative outputs (app.py before deltas)."""
    decode = req.role == "decode"
    sent_tokens, sent_text = (1, None) if decode else (0, 0)
    chunks = []
    for out in outs:
        if sent_text is None:
            sent_text = out.prefill_text_offset or 0
        comp = out.outputs[0]
        chunk = GenerateChunk(
            request_id=out.request_id,
            token_offset=sent_tokens,
            token_ids=comp.token_ids[sent_tokens:],
            text_offset=sent_text,
            text=comp.text[sent_text:],
            logprobs=[to_entries(lp) for lp in comp.logprobs[sent_tokens:]] if comp.logprobs is not None else None,
            finish_reason=comp.finish_reason if out.finished else None,
            stop_reason=comp.stop_reason,
            kv_handle=out.kv_handle,
            kv_handoff_sent=out.kv_handoff_sent,
            error=out.error,
            transfer_error=out.transfer_error,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens or 0,
        )
        sent_tokens = chunk.token_offset + len(chunk.token_ids)
        sent_text = chunk.text_offset + len(chunk.text)
        if chunk.token_ids or chunk.text or out.finished:
            chunks.append(chunk)
    return chunks
