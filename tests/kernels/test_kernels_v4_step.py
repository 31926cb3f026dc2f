"""DeepSeek-V4's decode-step metadata in kernels (kernels/v4_step.py, through
model/deepseek_v4/decode_step.py) against step.py's torch build of the same step (which the
engine tests check against transformers): every field of the V4Step, its entry indexes and group
plans equal (integers bit for bit; cos / sin within an ulp: numpy's cos here, torch's there), on
seeded random decode batches of odd sizes, rates under and over the block size, positions in the
first window and the first group, outputs poisoned.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402

from pdserve.model.batch import ForwardBatch, StepInputs  # noqa: E402
from pdserve.model.config_base import RopeConfig  # noqa: E402
from pdserve.model.deepseek_v4.decode_step import build_decode_step  # noqa: E402
from pdserve.model.deepseek_v4.step import build_step  # noqa: E402
from pdserve.model.rope import RotaryEmbedding  # noqa: E402
from tests.helpers.kernels import DEVICE, assert_fields_equal, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)
require_interpreter()
YARN = RopeConfig(rope_type="yarn", theta=160000.0, factor=16.0, original_max_position_embeddings=64)


def _batch(B: int, bs: int, window: int, longest: int, seed: int) -> ForwardBatch:
    """B one-token chunks at random positions (some below the window and the first group), every
    window position with a block, random distinct blocks."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, longest, (B,), generator=g)
    starts[0], starts[-1] = longest - 1, min(2, longest - 1)
    cols = longest // bs + 1
    tables = torch.randperm(B * cols * 3, generator=g)[: B * cols].view(B, cols)
    window_tables = torch.randperm(B * cols * 2, generator=g)[: B * cols].view(B, cols)
    step = StepInputs(
        input_ids=torch.randint(0, 100, (B,), generator=g), lens=torch.ones(B, dtype=torch.int64), starts=starts,
        samples=torch.ones(B, dtype=torch.bool), block_tables=tables, window_tables=window_tables,
        state_slots=torch.randperm(2 * B, generator=g)[:B],
    )  # fmt: skip
    return ForwardBatch.build(step, bs).to(DEVICE)


@pytest.mark.parametrize(
    "B,bs,window,longest,csa,hca",
    [(1, 16, 8, 300, {4}, {128}), (3, 16, 5, 40, {4}, {8}), (7, 8, 16, 531, {4}, {32, 128}), (2, 16, 8, 3, {4}, {16})],
)
def test_decode_step_equals_step_py(B, bs, window, longest, csa, hca, poisoned):
    batch = _batch(B, bs, window, longest, seed_of("v4_step", B, bs, window, longest))
    rotary = {"main": RotaryEmbedding(RopeConfig(theta=10000.0), 8), "compress": RotaryEmbedding(YARN, 8)}
    want = build_step(batch, rotary, window, csa, hca)
    got = build_decode_step(batch, rotary, window, csa, hca)
    assert_fields_equal(got, want, "step")
    assert set(got.entries) == csa | hca


def test_rate_entries_refuses_a_prefill_step():
    from pdserve_kernels.v4_step import rate_entries

    pos = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="decode step"):
        rate_entries(pos, pos.int(), pos[:1], pos[:1], torch.zeros(1, 4, dtype=torch.int32, device=DEVICE), 16, 4,
                     0, False, (torch.ones(4, device=DEVICE), 1.0))  # fmt: skip
