"""DeepSeek-V4's metadata of steps with chunks (kernels/v4_chunk_step.py, through
model/deepseek_v4/chunk_step.py) against step.py's torch build of the same step (which the engine
tests check against transformers): every field of the V4Step, its entry indexes and group plans
equal (integers bit for bit; cos / sin within an ulp: numpy's cos here, torch's there), on seeded
random batches: verify steps (every chunk 2..4 tokens), chunk graphs' batches (verify chunks of
different lengths, plain decodes and a padding sequence), mixed steps (one-token rows among longer
chunks), prefill chunks from 0 and mid-sequence, starts in the first window and the first group,
window blocks as engine/block_manager.py gives them, rates under and over the block size, block
sizes 16 and 64, outputs poisoned.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

from pdserve.model.batch import ForwardBatch, StepInputs  # noqa: E402
from pdserve.model.config_base import RopeConfig  # noqa: E402
from pdserve.model.deepseek_v4 import chunk_step  # noqa: E402
from pdserve.model.deepseek_v4.chunk_step import build_chunk_step, fused_chunk_step  # noqa: E402
from pdserve.model.deepseek_v4.step import build_step  # noqa: E402
from pdserve.model.rope import RotaryEmbedding  # noqa: E402
from tests.helpers.kernels import DEVICE, assert_fields_equal, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)
require_interpreter()
YARN = RopeConfig(rope_type="yarn", theta=160000.0, factor=16.0, original_max_position_embeddings=64)


def _batch(starts: list[int], lens: list[int], bs: int, window: int, seed: int, pad: int = 0) -> ForwardBatch:
    """Chunks lens[b] at starts[b] over random distinct blocks; window blocks as the block manager
    gives them: the last W-1 positions before each chunk and the chunk's last W-1 (-1 elsewhere).
    pad > 0: a chunk graph's batch (engine/cuda_graphs.py): a padding sequence of pad tokens at
    positions 0.. whose every block and window block is the scratch one, every row a decode row."""
    if pad:
        starts, lens = starts + [0], lens + [pad]
    g, B, K = torch.Generator().manual_seed(seed), len(starts), window - 1
    cols = -(-max(n + ln for n, ln in zip(starts, lens)) // bs) + 1
    tables = torch.randperm(B * cols * 3, generator=g)[: B * cols].view(B, cols)
    wtables = torch.randperm(B * cols * 2, generator=g)[: B * cols].view(B, cols).clone()
    for b, (n, ln) in enumerate(zip(starts, lens)):
        first_new = max(n, n + ln - K)  # the step writes positions first_new .. n + ln - 1
        for i in range(cols):
            below = (i + 1) * bs <= n - K  # every position of the block is out of the window
            unwritten = (n == 0 or (n - 1) // bs < i) and i < first_new // bs
            if below or unwritten or i * bs >= n + ln:
                wtables[b, i] = -1
    if pad:  # the scratch blocks: one past those handed out
        tables[-1], wtables[-1] = B * cols * 3, B * cols * 2
    step = StepInputs(
        input_ids=torch.randint(0, 100, (sum(lens),), generator=g), lens=torch.tensor(lens), starts=torch.tensor(starts),
        samples=torch.ones(B, dtype=torch.bool), block_tables=tables, window_tables=wtables,
        state_slots=torch.randperm(2 * B, generator=g)[:B], state_dst=torch.randperm(2 * B, generator=g)[:B],
    )  # fmt: skip
    return ForwardBatch.build(step, bs, as_decode_rows=pad > 0).to(DEVICE)


def _chunks(kind: str, rng: random.Random, window: int) -> tuple[list[int], list[int]]:
    """(starts, lens) of a step of this kind."""
    near0 = [0, 1, 2, 3, window - 2, window - 1, window, 127, 128]
    if kind == "verify":  # k + 1 tokens a sequence, some starts below the window / first group
        B = rng.choice([1, 2, 5, 17])
        return [rng.choice(near0 + [rng.randint(0, 600)] * 3) for _ in range(B)], [rng.randint(2, 4)] * B
    if kind == "verify mixed k":  # a chunk graph's: verify chunks of different k, plain decodes, padding
        B = rng.randint(3, 9)
        return [rng.choice(near0 + [rng.randint(0, 600)]) for _ in range(B)], [
            rng.choice([1, 2, 3, 4]) for _ in range(B)
        ]
    if kind == "mixed":  # prefill chunks with one-token rows
        B = rng.randint(2, 6)
        lens = [rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(B)]
        lens[0] = max(lens[0], 2)
        return [rng.choice(near0 + [rng.randint(0, 400)]) for _ in range(B)], lens
    # prefill: a chunk from 0 and one mid-sequence (longer than the window and a rate-128 group)
    return [0, rng.randint(1, 300)], [rng.randint(130, 200), rng.randint(window, 150)]


CASES = [  # kind, bs, window, rope dims, csa rates, hca rates
    ("verify", 16, 8, 8, {4}, {128}),
    ("verify", 64, 128, 64, {4}, {128}),
    ("verify", 16, 5, 8, {4}, {8, 32}),
    ("verify mixed k", 64, 16, 8, {4}, {128}),
    ("verify mixed k", 16, 128, 16, {4}, {16}),
    ("mixed", 16, 8, 8, {4}, {128}),
    ("mixed", 64, 128, 8, {4}, {128}),
    ("prefill", 16, 8, 8, {4}, {128}),
    ("prefill", 64, 128, 64, {4}, {128}),
]


@pytest.mark.parametrize("kind,bs,window,dim,csa,hca", CASES)
def test_chunk_step_equals_step_py(kind, bs, window, dim, csa, hca, poisoned):
    rng = random.Random(seed_of("v4_chunk_step", kind, bs, window, dim))
    rotary = {"main": RotaryEmbedding(RopeConfig(theta=10000.0), dim), "compress": RotaryEmbedding(YARN, dim)}
    for trial in range(3):
        starts, lens = _chunks(kind, rng, window)
        pad = rng.randint(1, 6) if kind == "verify mixed k" else 0  # as a chunk graph pads the step
        batch = _batch(starts, lens, bs, window, rng.randint(0, 2**31), pad)
        want = build_step(batch, rotary, window, csa, hca)
        got = build_chunk_step(batch, rotary, window, csa, hca)
        assert_fields_equal(got, want, f"step ({kind} {trial}: starts {starts}, lens {lens})")
        assert set(got.entries) == csa | hca


def test_window_only_step_equals_step_py(poisoned):
    """The MTP layer's step: the window fields and ropes, no compressor rate."""
    rotary = {"main": RotaryEmbedding(RopeConfig(theta=10000.0), 8), "compress": RotaryEmbedding(YARN, 8)}
    batch = _batch([0, 5, 40], [3, 3, 1], 16, 8, seed_of("v4_chunk_step", "mtp"))
    assert_fields_equal(
        build_chunk_step(batch, rotary, 8, set(), set()), build_step(batch, rotary, 8, set(), set()), "step"
    )


def test_steps_the_kernels_do_not_take(monkeypatch):
    """Decode steps (decode_step.py's), the torch path, and more sequences than the kernels'
    prefix sums hold (the wrappers refuse them, and rows that are not contiguous)."""
    from pdserve.model import ops
    from pdserve_kernels.v4_chunk_step import MAX_B, chunk_rate_entries, chunk_window_rope

    rotary = {"main": RotaryEmbedding(RopeConfig(theta=10000.0), 8), "compress": RotaryEmbedding(YARN, 8)}
    assert chunk_step.MAX_B == MAX_B  # the model's bound is the kernels'
    chunks = _batch([3, 9, 0], [2, 1, 1], 16, 8, 1)
    ops.set_backend("torch")
    assert not fused_chunk_step(chunks, rotary)
    ops.set_backend("triton")
    try:
        assert fused_chunk_step(chunks, rotary)
        assert not fused_chunk_step(_batch([3, 9], [1, 1], 16, 8, 1), rotary)
        assert not fused_chunk_step(chunks, {"main": rotary["main"]})
        monkeypatch.setattr(chunk_step, "MAX_B", 2)
        assert not fused_chunk_step(chunks, rotary)
    finally:
        ops.set_backend(None)
    big = _batch([0] * (MAX_B + 1), [2] * (MAX_B + 1), 16, 8, 2)
    rope = (torch.ones(4, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="at most"):
        chunk_rate_entries(big.positions, big.seq_ids, big.starts, big.lens, big.block_tables, 16, 4, 0, False, rope)
    strided = torch.stack([chunks.positions, chunks.positions], 1)[:, 0]  # a column: not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        chunk_window_rope(strided, chunks.seq_ids, chunks.starts, chunks.lens, chunks.window_tables, 16, 8, [rope] * 2)
