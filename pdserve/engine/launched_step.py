"""A step queued on the device and its sampled tokens on their way to the host: what the engine
holds between launching a step and reading it (the overlapped loop, llm_engine.py), and the feed
that gives a step's rows the tokens a step still in flight sampled."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.engine.sampler import SampledToken, StagedTokens
from pdserve.engine.sequence import Sequence

WHILE_BUSY_POLL_S = 2e-4  # how late a step's end may be seen while the engine works beside it


def work_until(done: Callable[[], bool], work: Callable[[], None], poll_s: float = WHILE_BUSY_POLL_S) -> None:
    """work() at once and then every poll_s until done(). The sleep gives the GIL to the server's
    threads, as the blocking read of a step's tokens would."""
    work()
    while not done():
        time.sleep(poll_s)
        work()


Feed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (input rows, token rows, tokens) on the device


class LaunchedStep:
    """A step queued on the device. seqs: its rows that sample, in order. staged: their tokens on
    the way to the host; verify: a verify step's sampling, done on the host when read."""

    def __init__(
        self,
        seqs: list[Sequence],
        staged: StagedTokens | None = None,
        verify: Callable[[Callable[[], None] | None], list[SampledToken]] | None = None,
    ) -> None:
        self.seqs, self.staged, self.verify = seqs, staged, verify

    @torch.inference_mode()
    def read(self, while_busy: Callable[[], None] | None = None) -> list[SampledToken]:
        """The sampled tokens, one per row of seqs. while_busy: called (at least once) while the
        device computes, instead of blocking in the read."""
        if self.verify is not None:
            return self.verify(while_busy)
        if self.staged is None:
            return []
        if while_busy is not None:
            work_until(self.staged.ready, while_busy) if self.staged.done is not None else while_busy()
        return self.staged.read()


def feed_from(holes: list[tuple[int, Sequence]], prev: LaunchedStep | None, device: torch.device) -> Feed | None:
    """(rows of a step's input_ids, rows of prev's tokens, prev's tokens), on the device: each
    hole (ModelRunner.prepare) is a sequence's last token, which prev sampled and the host has
    not read yet. None without holes."""
    if not holes:
        return None
    if prev is None or prev.staged is None:
        raise RuntimeError("a step's input token is in flight but no launched step sampled it")
    row_of = {id(seq): i for i, seq in enumerate(prev.seqs)}
    dst = torch.tensor([r for r, _ in holes], dtype=torch.int64)
    src = torch.tensor([row_of[id(seq)] for _, seq in holes], dtype=torch.int64)
    return dst.to(device, non_blocking=True), src.to(device, non_blocking=True), prev.staged.tokens


def wait_for_device(device: torch.device) -> None:
    """Wait for every step queued on the device (a hand-off of KV no token was read from: forks.py)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def needs_host(seq: Sequence) -> bool:
    """A row whose next step needs this step's token on the host: its grammar's mask, penalties
    over its tokens, or its KV handed to a decode worker once the step is done."""
    p = seq.params
    penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return seq.grammar is not None or penalized or seq.hold_kv
