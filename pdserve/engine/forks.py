"""n > 1 and best_of: one prompt, computed once, several answers.

A request asking for several sequences (SamplingParams.num_seqs: best_of, or n) starts as one
sequence, index 0. The scheduler ends a chunk of its prompt just before the last token
(`fork_at`, Scheduler's `_fork_cut`), so that when the step that computes the last token is scheduled, every
position before it is in the cache: there it forks (`Forker`). The other sequences, index 1 ..,
take its KV by reference (BlockManager.fork: the blocks no later step writes are shared, the rest
and the window and state copied before the step's forward) and each computes the last prompt
token itself in that step, so each samples its first token with its own draws: a seeded request's
sequence i draws with seed + i (vLLM's per-child seed), greedy ones all give the n = 1 answer.
From there they are sequences like any other (preempted, stopped, aborted alone); the request's
outputs gather them by index (step_outputs.py) and it is finished when all of them are.

A child that finds no room in the step (max_num_seqs, the token budget) waits at the front with
its forked blocks; one whose blocks the pool cannot give waits without any and computes its prompt
again (with prefix caching, mostly from the cache).

Under PD the prefill worker stops at the same point: it hands off the KV of every prompt token but
the last, without a first token, and the decode worker forks once the load lands.

best_of > n: all best_of sequences run and the output comes once all are done: the n with the
highest cumulative logprob (vLLM's ranking), as indices 0 .. n - 1; their logprobs are computed
for the ranking and given out only when the request asked for them.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams


def ranking_params(params: SamplingParams) -> SamplingParams:
    """best_of > n ranks by cumulative logprob: the sampled token's logprob is computed then."""
    if params.num_seqs > params.n and params.logprobs is None:
        return params.model_copy(update={"logprobs": 0})
    return params


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The index-th sequence's parameters: its own seeded stream (seed + index), as vLLM's children."""
    if params.seed is None or index == 0:
        return params
    return params.model_copy(update={"seed": params.seed + index})


def hands_off_at_fork(seq: Sequence) -> bool:
    """A prefill worker's sequence whose launched chunk reached its fork point: its KV goes to
    the decode worker, which forks."""
    return seq.hold_kv and seq.fork_at is not None and seq.num_computed_tokens == seq.fork_at


class Forker:
    """Forks the sequences a step computes the last prompt token of (before the step launches)."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        new_child: Callable[[Sequence, int], Sequence],
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.new_child = new_child  # (parent, index) -> the child, no blocks yet (new_sequence.py)

    def fork_scheduled(self, sched: SchedulerOutput) -> None:
        for s in list(sched.scheduled):
            parent = s.seq
            if parent.group is None or parent.fork_at is None or s.start != parent.fork_at:
                continue
            parent.fork_at = None
            for index in range(1, parent.group.size):
                child = self.new_child(parent, index)
                parent.group.seqs.append(child)
                self._place(parent, child, sched)

    def _place(self, parent: Sequence, child: Sequence, sched: SchedulerOutput) -> None:
        """child into this step where there is room, else at the front of waiting."""
        if not self.block_manager.fork(parent, child):
            self.scheduler.add(child)  # computes its prompt again when blocks free up
        elif not self.scheduler.join_step(child, sched):
            self.scheduler.add_front(child)  # holds its forked blocks meanwhile
