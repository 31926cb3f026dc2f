import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams


def seq(name: str, n: int = 1) -> Sequence:
    return Sequence(Request(request_id=name, prompt_token_ids=list(range(n)), params=SamplingParams()))


def test_allocate_grow_and_free_return_to_zero():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 5)
    assert len(a.block_table) == 2 and bm.num_used_blocks == 2
    bm.allocate(a, 8)  # still fits in two blocks
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    bm.allocate(b, 28)
    assert bm.num_used_blocks == 10 and bm.num_free_blocks == 0
    assert len(set(a.block_table) | set(b.block_table)) == 10  # no block handed out twice
    assert not bm.can_allocate(a, 13) and bm.can_allocate(a, 12)
    with pytest.raises(RuntimeError, match="needs 1 blocks, 0 free"):
        bm.allocate(a, 13)
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and bm.num_used_blocks == 0 and bm.num_free_blocks == 10


def test_blocks_needed_and_double_free():
    bm = BlockManager(num_blocks=4, block_size=3)
    a = seq("a")
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(3) == 1 and bm.blocks_for(4) == 2
    assert bm.blocks_needed(a, 7) == 3
    bm.allocate(a, 4)
    assert bm.blocks_needed(a, 4) == 0 and bm.blocks_needed(a, 7) == 1
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(a)


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq("a")
    bm.allocate(a, 6)
    first = list(a.block_table)
    bm.free(a)
    b = seq("b")
    bm.allocate(b, 6)
    assert sorted(b.block_table) == sorted(first)


def test_invalid_sizes():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)


def test_window_space_keeps_only_the_window():
    """Window of 6 tokens, blocks of 4: a step from n0 to n1 gets window blocks for its new
    positions among the last 6 of n1; blocks wholly before the last 6 of n0 are freed."""
    bm = BlockManager(num_blocks=20, block_size=4, window_tokens=6, num_window_blocks=8)
    assert BlockManager.window_blocks_per_seq(6, 4) == 6
    a = seq("a", 30)
    assert bm.can_allocate(a, 30, step_end=10)
    bm.allocate(a, 30, step_end=10)  # prefill chunk [0, 10): writes positions 4..9 of the window
    assert len(a.block_table) == 8 and a.window_table == [-1, 0, 1]
    a.num_computed_tokens = 10
    bm.trim_window(a)  # reads [4, 10) next: block 1 (4..7) and block 2 (8..11) stay
    assert a.window_table == [-1, 0, 1] and bm.num_used_window_blocks == 2
    bm.allocate(a, 30, step_end=25)  # chunk [10, 25): the step reads [4, 10), writes 19..24
    assert a.window_table == [-1, 0, 1, -1, 2, 3, 4]
    a.num_computed_tokens = 25
    bm.trim_window(a)  # later steps read [19, 25): blocks 4..6
    assert a.window_table == [-1, -1, -1, -1, 2, 3, 4] and bm.num_used_window_blocks == 3
    for n in range(25, 30):  # decode: one block at a time, the oldest freed behind
        bm.allocate(a, n + 1)
        a.num_computed_tokens = n + 1
        bm.trim_window(a)
        held = [i for i, b in enumerate(a.window_table) if b >= 0]
        assert held == list(range((n + 1 - 6) // 4, -(-(n + 1) // 4)))
    bm.free(a)
    assert a.window_table == [] and bm.num_used_window_blocks == 0 and bm.num_used_blocks == 0


def test_window_space_runs_out_and_checks_its_size():
    bm = BlockManager(num_blocks=20, block_size=4, window_tokens=6, num_window_blocks=6)
    a, b = seq("a", 12), seq("b", 12)
    bm.allocate(a, 12)  # positions 6..11: blocks 1 and 2
    bm.allocate(b, 12)
    bm.allocate(seq("c", 4), 4)
    assert bm.num_used_window_blocks == 5
    d = seq("d", 12)
    assert not bm.can_allocate(d, 12)  # two window blocks needed, one free
    with pytest.raises(RuntimeError, match="needs 2 window blocks, 1 free"):
        bm.allocate(d, 12)
    assert bm.num_used_window_blocks == 5 and d.window_table == [] and d.block_table == []  # nothing taken
    with pytest.raises(ValueError, match="needs at least 6 window blocks"):
        BlockManager(num_blocks=4, block_size=4, window_tokens=6, num_window_blocks=5)
