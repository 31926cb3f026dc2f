"""A worker's per-request timing (pdserve/worker/timing.py) on a made-up clock: the parts it reports
add up to arrival -> the end of the step that gave the first new token, for each role."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.disagg.stats import LoadRecord, TransferStats
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.worker.timing import RequestTimer


def out(rid: str, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt_token_ids=[1], outputs=[CompletionOutput(token_ids=[7] * tokens)], finished=finished
    )


def step(*rids: str) -> SimpleNamespace:  # what on_step reads of a SchedulerOutput
    return SimpleNamespace(scheduled=[SimpleNamespace(seq=SimpleNamespace(request_id=r)) for r in rids])


def test_prefill_queue_then_compute_over_chunked_steps():
    t = RequestTimer()
    t.add("a", 10.0, tokens_before=0)
    t.on_step(step(), 10.1)  # a step without it: still queued
    t.on_step(step("a"), 10.5)  # first chunk
    assert t.first_token(out("a", 0), 10.7, None) is None  # a chunk that samples nothing
    t.on_step(step("a"), 10.7)  # last chunk: samples
    timing = t.first_token(out("a", 1, finished=True), 10.9, None)
    assert (timing.queue_s, timing.compute_s, timing.transfer_s) == pytest.approx((0.5, 0.4, None))
    assert t.first_token(out("a", 2), 11.0, None) is None  # once only


def test_a_step_that_started_before_the_arrival_counts_from_the_arrival():
    t = RequestTimer()
    t.add("a", 10.0, tokens_before=0)
    t.on_step(step("a"), 9.9)
    timing = t.first_token(out("a", 1), 10.3, None)
    assert (timing.queue_s, timing.compute_s) == pytest.approx((0.0, 0.3))


def test_decode_waits_for_blocks_reads_then_decodes():
    t, stats = RequestTimer(), TransferStats()
    t.add("d", 20.0, tokens_before=1)  # arrives with prefill's first token
    stats.record_done(LoadRecord("other", 10, 20.0, 0.5, 1))
    stats.record_done(LoadRecord("d", 4096, 20.25, 0.05, 3))
    assert t.first_token(out("d", 1), 20.2, stats) is None  # only the token it came with
    t.on_step(step("d"), 20.31)
    timing = t.first_token(out("d", 2), 20.35, stats)
    assert timing.queue_s == pytest.approx(0.25) and timing.transfer_s == pytest.approx(0.05)
    assert timing.compute_s == pytest.approx(0.05) and timing.transfer_bytes == 4096
    assert timing.queue_s + timing.transfer_s + timing.compute_s == pytest.approx(0.35)


def test_decode_without_a_read_recomputed_and_forgotten_requests():
    t, stats = RequestTimer(), TransferStats()
    t.add("r", 5.0, tokens_before=1)  # its read failed: the prompt is recomputed here
    t.on_step(step("r"), 5.5)
    timing = t.first_token(out("r", 2), 6.0, stats)
    assert (timing.queue_s, timing.compute_s, timing.transfer_s) == pytest.approx((0.5, 0.5, None))
    t.add("x", 1.0, tokens_before=0)
    assert t.first_token(out("x", 0, finished=True), 2.0, None) is None  # aborted before a token
    assert t.first_token(out("x", 1), 2.1, None) is None  # forgotten
    t.add("y", 1.0, tokens_before=0)
    t.forget("y")
    assert t.first_token(out("y", 1), 2.0, None) is None
