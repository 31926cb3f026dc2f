"""Host time per decode step outside the model: what the engine does with each sampled token
(detokenize, stop strings, logprob entries, the step's RequestOutputs) for B sequences that
already hold L output tokens. No forward runs: `LLMEngine._resolve` reads a step whose
sampled tokens are given, so the time is the engine's own, on the host (CPU).

    python -m benchmarks.engine.bench_outputs [--batch 64] [--lengths 100,16384] [--steps 200]

Each sequence asks for logprobs (the sampled token and one alternative) and two stop strings that
never match (their hold-back is checked every token); its tokens are the tiny model's tokenizer
on English and multi-byte text, so characters split across tokens are held back as they would be.
Rows per output kind (SamplingParams.output_kind): cumulative (every output carries the whole
output so far), delta (the new part only: what a worker streams), final_only (`LLM.generate`).
Prints a markdown table (median and p90 ms per step); `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.tiny_model import make_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog, café naïve 中文的句子 😀👍🏽 and then some more words. "
STOP = ["\x00never\x00", "<<<END>>>"]


def engine(model_dir: str) -> LLMEngine:
    cfg = EngineConfig(model=model_dir, num_kv_blocks=64, max_num_seqs=1024, enable_prefix_caching=False)
    eng = LLMEngine(cfg)
    eng.max_model_len = 1 << 30  # no forward runs: sequences may grow past the model's length
    return eng


def sequences(eng: LLMEngine, batch: int, length: int, kind: RequestOutputKind) -> tuple[list[Sequence], list]:
    """batch sequences already holding `length` output tokens; the token stream they continue with."""
    ids = eng.tokenizer.encode(TEXT * 8, add_special_tokens=False)
    params = SamplingParams(max_tokens=None, ignore_eos=True, logprobs=1, stop=STOP, output_kind=kind)
    for i in range(batch):
        eng.add_request(Request(request_id=f"{kind.value}-{length}-{i}", prompt_token_ids=ids[:16], params=params))
    seqs, eng._new = eng._new, []
    stream = itertools.cycle(ids)
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
        for tok in itertools.islice(stream, length):
            eng._append(seq, _sampled(tok))
    return seqs, stream


def _sampled(tok: int) -> SampledToken:
    return SampledToken(tok, logprobs=[(tok, -0.25, 1), (tok + 1, -1.5, 2)])


def time_steps(eng: LLMEngine, seqs: list[Sequence], stream, steps: int) -> list[float]:
    sched = SchedulerOutput(scheduled=[ScheduledSeq(seq=s, start=0, num_tokens=1, samples=True) for s in seqs])
    times = []
    for _ in range(steps):
        sampled = [_sampled(next(stream)) for _ in seqs]
        t0 = time.perf_counter()
        touched: dict = {}
        for s in seqs:  # as a launch leaves them: each row's token in flight
            s.num_inflight += 1
        eng._resolve((sched, LaunchedStep(seqs, verify=lambda _busy, sampled=sampled: sampled)), touched, poll=False)
        outs = eng._outputs(touched)
        times.append(1e3 * (time.perf_counter() - t0))
        assert all(not o.finished for o in outs)
    return times


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lengths", default="100,16384", help="output tokens each sequence holds, comma-separated")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kinds", default="cumulative,delta,final_only")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(str(make_tiny_model(tmp)))
    rows = []
    print(f"| output kind | output tokens held | ms / step (median) | p90 | B = {args.batch} |")
    print("| --- | ---: | ---: | ---: | --- |")
    for kind in (RequestOutputKind(k) for k in args.kinds.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            seqs, stream = sequences(eng, args.batch, length, kind)
            times = sorted(time_steps(eng, seqs, stream, args.steps))
            row = {"kind": kind.value, "length": length, "batch": args.batch,
                   "median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}  # fmt: skip
            rows.append(row)
            print(f"| {kind.value} | {length} | {row['median_ms']:.3f} | {row['p90_ms']:.3f} | |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
