"""The engine loop per decode step against the step itself: B sequences decoding at a context,
`LLMEngine.step()` timed whole (admission, schedule, prepare, launch, the read of the step
before, stop checks, outputs) in the serial loop and in the overlapped one (async_scheduling),
beside `ModelRunner.run` of the same batch alone (the device step the loop can at best keep pace
with: the floor of this table; the serial loop is its naive baseline).

    python -m benchmarks.engine.bench_loop --model v4-flash --num-layers 4 --dtype fp4 \
        --batch-sizes 1,16,64 --context 1024

Takes `pdserve bench-engine`'s model flags (--model, --num-layers, --dtype, --kv-cache-dtype,
--kv-block-size, --device, --seed). Every request is greedy with ignore_eos and wants its tokens
detokenized by nothing (no tokenizer: a dummy model has none), so the host work is the engine's
own; delta outputs, as a worker streams. One engine serves every row; the mode is switched on it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine import cli
from pdserve.bench.engine.models import bench_config, engine_quantization, write_config
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.sampling_params import RequestOutputKind, SamplingParams


def _sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def loop_ms(
    engine: LLMEngine, batch: int, context: int, steps: int, warmup: int, seed: int
) -> tuple[float, list[float]]:
    """(median ms of `step()` over `steps` decode steps of `batch` sequences, each step's ms);
    the requests are added, prefilled and warmed up first, then aborted and drained."""
    rng = random.Random(seed)
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = [f"r{batch}-{i}-{rng.random()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(
            Request(request_id=rid, prompt_token_ids=[rng.randrange(4, vocab) for _ in range(context)], params=params)
        )
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    for _ in range(warmup):
        engine.step()
    _sync(engine)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
        assert len(outs) == batch and not any(o.finished for o in outs), "a request ended inside the timed steps"
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), times


def run_ms(engine: LLMEngine, batch: int, context: int, steps: int, seed: int) -> float:
    """Median ms of `ModelRunner.run` alone on the same batch: the step the loop schedules, run
    again and again (it writes the same KV slots; nothing is appended)."""
    rng = random.Random(seed)
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [f"run{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(
            Request(request_id=rid, prompt_token_ids=[rng.randrange(4, vocab) for _ in range(context)], params=params)
        )
    engine.async_scheduling, mode = False, engine.async_scheduling
    try:
        while True:  # serial steps until one is every request's decode
            engine.step()
            sched = engine.last_schedule
            if sched is not None and len(sched.scheduled) == batch and not any(s.is_prefill for s in sched.scheduled):
                break
        sched = engine.scheduler.schedule()  # the next decode step, not run by the engine
        for _ in range(3):
            engine.runner.run(sched)
        times = []
        for _ in range(steps):
            _sync(engine)
            t0 = time.perf_counter()
            engine.runner.run(sched)  # reads its tokens: synchronized
            times.append(1e3 * (time.perf_counter() - t0))
    finally:
        engine.async_scheduling = mode
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_args(p)
    args = p.parse_args(argv)
    cli.check_args(args)
    batches, context = cli.batch_sizes(args), args.context
    extra = args.warmup + args.steps + 16
    blocks = 2 * max(batches) * -(-(context + extra) // args.kv_block_size)
    model_json = bench_config(args.model, args.num_layers, args.quantization)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-loop-") as folder:
        config = EngineConfig(
            model=str(write_config(model_json, Path(folder))), device=args.device, dtype=args.dtype,
            load_format="dummy", quantization=engine_quantization(args.quantization), kv_cache_dtype=args.kv_cache_dtype,
            fp4_moe_backend=args.fp4_moe_backend, enforce_eager=args.enforce_eager, kv_block_size=args.kv_block_size,
            num_kv_blocks=blocks, max_num_seqs=max(batches), max_model_len=context + extra + 1, seed=args.seed,
            skip_tokenizer_init=True, enable_prefix_caching=False,
        )  # fmt: skip
        engine = LLMEngine(config)
    device = engine.runner.device
    rows = []
    print(f"{args.model}, {args.num_layers or 'all'} layers, {args.dtype}{' + ' + args.quantization if args.quantization else ''}, "
          f"context {context}, {cli.environment(device)['device']}")  # fmt: skip
    print(
        "| B | step alone (`ModelRunner.run`), ms | serial loop, ms | overlapped loop, ms | serial / step | overlapped / step |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        alone = run_ms(engine, b, context, args.steps, args.seed)
        row = {"batch": b, "context": context, "run_ms": alone}
        for name, mode in (("serial", False), ("overlapped", True)):
            engine.async_scheduling = mode
            row[f"{name}_ms"], row[f"{name}_steps_ms"] = loop_ms(engine, b, context, args.steps, args.warmup, args.seed)
        rows.append(row)
        print(f"| {b} | {alone:.3f} | {row['serial_ms']:.3f} | {row['overlapped_ms']:.3f} | "
              f"{row['serial_ms'] / alone:.2f} | {row['overlapped_ms'] / alone:.2f} |", flush=True)  # fmt: skip
    report = {"environment": cli.environment(device), "model": model_json, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    engine.shutdown()
    return report


if __name__ == "__main__":
    main()
