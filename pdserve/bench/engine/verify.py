"""Speculative decoding's verify steps against plain decode steps, on the same batch and context.

A verify step runs every sequence's last token and k random drafts as one chunk (the engine's
`ScheduledSeq` with `num_spec = k`: logits at the k + 1 positions, acceptance on the device,
the tokens read back) and leaves the sequences as they were: the drafts' KV lies past their
computed tokens, as rejected drafts' does in the engine; on a pool with per-sequence state
(DeepSeek-V4) the new state goes to a spare slot, as the engine's verify chunks write it
(spec_decode/spare_states.py), freed after the step. Random weights accept nothing, so the
speed-up at an accept length L (tokens a verify step emits on average, 1 <= L <= k + 1) is
computed, not measured: L x plain step / verify step. The engine is built with k's largest value as
its speculative_config, so on CUDA a verify step replays a captured graph as a plain step does
(engine/cuda_graphs.py: V3's chunk tokens as decode rows, V4's equal chunks as chunk graphs);
`graphed` says whether it did.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from pdserve.bench.engine.ceilings import sync
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence

ACCEPT_LENGTHS = (1.5, 2.0, 2.5)


def verify_step(bench, seqs: list[Sequence], k: int) -> float:
    """Seconds of one `ModelRunner.run` verifying k drafts of every sequence."""
    for seq in seqs:
        seq.spec_token_ids = torch.randint(bench.vocab, (k,), generator=bench.gen).tolist()
        bench.blocks.allocate(seq, seq.num_tokens + k, seq.num_computed_tokens + 1 + k)
    sched = verify_schedule(seqs, k)
    for s in sched.scheduled:
        if s.seq.state_slot >= 0:  # the runner sizes 2 state slots a sequence: one is free
            s.state_dst = _spare(bench.blocks)
    sync(bench.device)
    t0 = time.perf_counter()
    bench.runner.run(sched)
    sync(bench.device)
    seconds = time.perf_counter() - t0
    for s in sched.scheduled:
        s.seq.spec_token_ids = []
        if s.state_dst >= 0:
            bench.blocks.give_back_state(s.state_dst, s.seq.request_id)
    return seconds


def verify_schedule(seqs: list[Sequence], k: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[ScheduledSeq.of(s, 1 + k) for s in seqs])


def graphed(bench, seqs: list[Sequence], k: int) -> bool:
    """Whether a verify step of k drafts a sequence replays a CUDA graph."""
    if bench.runner.graphs is None:
        return False
    for seq in seqs:
        seq.spec_token_ids = [0] * k
    fits = bench.runner.graphs.fits(bench.runner.prepare(verify_schedule(seqs, k))[0])
    for seq in seqs:
        seq.spec_token_ids = []
    return fits


def _spare(blocks) -> int:
    slot = blocks.take_spare_state()
    if slot is None:
        raise RuntimeError("no free state slot for a verify chunk's new state")
    return slot


def measure(
    bench, seqs: list[Sequence], ks: list[int], warmup: int, steps: int, floor_ms: Callable[[int], float] | None = None
) -> dict:
    """Median plain and verify step times (ms), their ratios, and the computed speed-ups.
    floor_ms(k): the floor of a step verifying k drafts a sequence (k = 0: a plain step); each
    verify step's floor is reported as a multiple of the plain step's (`floor_ratio`)."""
    for _ in range(warmup):
        bench.step(seqs)
    plain = 1e3 * statistics.median(bench.timed_steps(seqs, steps))
    out: dict = {"plain_ms": plain, "verify_ms": {}, "ratio": {}, "speedup": {}, "graphed": {}, "floor_ratio": {}}
    for k in ks:
        if floor_ms is not None:
            out["floor_ratio"][k] = floor_ms(k) / floor_ms(0)
        out["graphed"][k] = graphed(bench, seqs, k)
        for _ in range(warmup):
            verify_step(bench, seqs, k)
        ms = 1e3 * statistics.median(verify_step(bench, seqs, k) for _ in range(steps))
        out["verify_ms"][k], out["ratio"][k] = ms, ms / plain
        out["speedup"][k] = {L: L * plain / ms for L in ACCEPT_LENGTHS if L <= k + 1}
    return out


def format_verify(report: dict) -> str:
    rows = [r for r in report["rows"] if "verify" in r]
    if not rows:
        return ""
    ks = sorted({int(k) for r in rows for k in r["verify"]["verify_ms"]})
    head = "| batch | context | plain ms | " + " | ".join(f"k={k} ms (x plain)" for k in ks)
    head += " | " + " | ".join(f"speed-up at L={L} (k)" for L in ACCEPT_LENGTHS) + " |"
    lines = ["", "verify steps (speculative decoding; speed-ups computed: L x plain / verify; floor: the verify step's"
             " floor over the plain step's, k + 1 tokens a sequence touching more experts)", head,
             "| ---: " * (3 + len(ks) + len(ACCEPT_LENGTHS)) + "|"]  # fmt: skip
    for r in rows:
        v = r["verify"]
        cells = [_cell(v, k) for k in ks]
        for L in ACCEPT_LENGTHS:
            best = max(((s[L], k) for k, s in v["speedup"].items() if L in s), default=None)
            cells.append(f"{best[0]:.2f}x ({best[1]})" if best else "-")
        lines.append(f"| {r['batch']} | {r['context']} | {v['plain_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v: dict, k: int) -> str:
    floor = v.get("floor_ratio", {}).get(k)
    notes = [f"{v['ratio'][k]:.2f}x"] + ([f"floor {floor:.2f}x"] if floor is not None else [])
    return f"{v['verify_ms'][k]:.2f} ({', '.join(notes)}{'' if v['graphed'][k] else ', eager'})"
