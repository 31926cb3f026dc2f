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
