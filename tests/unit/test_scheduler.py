"""Scheduler policy, driven by a plain-Python loop (no model): each step every scheduled chunk is
'computed', and a chunk that reaches a sequence's last token appends one output token."""

from __future__ import annotations

import random

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import FirstToken, Request
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams

_arrival = iter(range(10**9))


def seq(name: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        Request(request_id=name, prompt_token_ids=[5] * prompt_len, params=SamplingParams(max_tokens=max_tokens)),
        arrival=next(_arrival),
    )


def advance(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Apply one step's results; returns sequences that finished."""
    done = []
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.append_token(7)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH)
                done.append(s.seq)
    return done


def run(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not (sched.running or sched.waiting):
            break
        out = sched.schedule()
        outs.append(out)
        check_invariants(sched, out)
        advance(sched, out)
    return outs


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING
        assert len(s.seq.block_table) * sched.block_manager.block_size >= s.start + s.num_tokens
    owned = [b for s in sched.running + list(sched.waiting) for b in s.block_table]
    assert len(owned) == len(set(owned)) == sched.block_manager.num_used_blocks


def test_long_prompt_is_chunked_by_the_budget():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a = seq("a", 40, max_tokens=2)
    sched.add(a)
    outs = run(sched)
    assert [(o.scheduled[0].start, o.scheduled[0].num_tokens) for o in outs] == [(0, 16), (16, 16), (32, 8), (40, 1)]
    assert [o.scheduled[0].samples for o in outs] == [False, False, True, True]
    assert [o.scheduled[0].is_prefill for o in outs] == [True, True, True, False]
    assert sched.block_manager.num_used_blocks == 0


def test_decodes_go_first_then_prefill_fills_the_budget():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    for i in range(3):
        sched.add(seq(f"d{i}", 2, max_tokens=50))
    advance(sched, sched.schedule())  # the three prefill together: 6 tokens
    sched.add(seq("long", 30))
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 7)]
    advance(sched, out)
    out = sched.schedule()  # the running chunked prefill comes after the decodes
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 7)]


def test_max_num_seqs_and_fifo_admission():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(str(i), 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["0", "1"]
    finished_order = []
    while sched.running or sched.waiting:
        finished_order += [s.request_id for s in advance(sched, sched.schedule())]
    assert finished_order == ["0", "1", "2", "3", "4"]
    assert sched.block_manager.num_used_blocks == 0


def test_admission_waits_for_free_blocks():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 10, max_tokens=2), seq("b", 8, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]  # b needs 2 blocks, 1 is free
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    run(sched)
    assert a.finished and b.finished and sched.block_manager.num_used_blocks == 0


def test_preemption_frees_the_youngest_and_recomputes_it():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    old, young = seq("old", 8, max_tokens=6), seq("young", 7, max_tokens=6)
    sched.add(old)
    sched.add(young)
    advance(sched, sched.schedule())  # both prefilled: 2 blocks each, all 4 used
    assert sched.block_manager.num_free_blocks == 0
    out = sched.schedule()  # old's next token needs a third block
    assert out.preempted == [young]
    assert young.status is SequenceStatus.WAITING and young.block_table == [] and young.num_computed_tokens == 0
    assert sched.waiting[0] is young and young.num_output_tokens == 1  # its output is recomputed, not lost
    assert [s.seq.request_id for s in out.scheduled] == ["old"]
    run(sched)
    assert old.finished and young.finished and sched.num_preemptions >= 1
    assert sched.block_manager.num_used_blocks == 0


def test_a_sequence_preempts_itself_when_it_is_the_youngest():
    sched = Scheduler(BlockManager(3, 2), max_num_seqs=8, max_num_batched_tokens=100)
    old, young = seq("old", 3, max_tokens=2), seq("young", 2, max_tokens=3)
    sched.add(old)
    sched.add(young)
    advance(sched, sched.schedule())  # old holds 2 blocks (room for 4 tokens), young 1 (full)
    out = sched.schedule()  # old decodes in place; young needs a block, and nobody is younger
    assert [s.seq.request_id for s in out.scheduled] == ["old"] and out.preempted == [young]
    assert young.block_table == [] and sched.waiting[0] is young
    run(sched)
    assert old.finished and young.finished and sched.block_manager.num_used_blocks == 0


def test_random_workloads_keep_block_accounting_exact():
    rng = random.Random(0)
    for trial in range(20):
        sched = Scheduler(
            BlockManager(rng.randint(8, 30), rng.choice([1, 2, 4, 8])), rng.randint(1, 6), rng.randint(4, 40)
        )
        capacity = sched.block_manager.num_total_blocks * sched.block_manager.block_size
        for i in range(rng.randint(1, 12)):
            prompt = rng.randint(1, capacity // 2)
            sched.add(seq(f"{trial}-{i}", prompt, max_tokens=rng.randint(1, capacity - prompt)))
        outs = run(sched)
        assert not sched.running and not sched.waiting
        assert sched.block_manager.num_used_blocks == 0, trial
        assert all(not o.is_empty for o in outs)


def test_remote_sequences_get_blocks_then_join_waiting():
    from pdserve.disagg.base import KVHandle

    sched = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=100)
    handles = []
    for i in range(3):
        h = KVHandle(
            request_id=str(i),
            engine_id="p",
            instance_id="i",
            metadata_url="",
            block_ids=[0, 1, 2],
            num_tokens=10,
            compat_hash="x",
            lease_expires_at=0.0,
        )
        s = Sequence(
            Request(
                request_id=str(i),
                prompt_token_ids=[5] * 10,
                params=SamplingParams(max_tokens=3),
                kv_handle=h,
                first_token=FirstToken(token_id=9),
            ),
            arrival=next(_arrival),
        )
        s.append_token(9)  # the first token, sampled by prefill
        sched.add_remote(s)
        handles.append(s)
    started = sched.admit_remote()
    assert [s.request_id for s in started] == ["0", "1"]  # 3 blocks each, 6 in all
    assert all(len(s.block_table) == 3 for s in started) and len(sched.remote_pending) == 1
    sched.on_loaded("0")
    assert handles[0].num_computed_tokens == 10 and sched.waiting[0] is handles[0]
    out = sched.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens, s.is_prefill) for s in out.scheduled] == [("0", 10, 1, False)]
    sched.finish(handles[1], SequenceStatus.FINISHED_ERROR)  # a failed load frees its blocks
    assert sched.admit_remote() == [handles[2]]
