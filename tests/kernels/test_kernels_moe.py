"""Fused MoE kernel (expert-sorted grouped GEMMs) against a float64 reference.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import configs  # noqa: E402
from pdserve_kernels.fused_moe import fused_moe, moe_align, moe_align_fast, sum_pairs  # noqa: E402
from pdserve_kernels.ref import fused_moe_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, assert_close, poisoned_empty, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def make(T, E, k, hidden, inter, dtype, gen, ids=None):
    x = torch.randn(T, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen).to(DEVICE)
    return x, w13, w2, weights, ids.to(DEVICE, torch.int32)


def check(x, w13, w2, weights, ids, dtype, config=None):
    with poisoned_empty():
        y = fused_moe(x, w13, w2, weights, ids, config=config)
    want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, want, dtype)


# (T, E, k, hidden, I): T = 1, sizes not multiples of the tiles, more experts than pairs.
SHAPES = [(1, 8, 2, 64, 32), (7, 6, 3, 80, 48), (20, 16, 4, 48, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    check(*make(*shape, dtype, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_experts_and_one_hot_expert(dtype):
    gen = torch.Generator().manual_seed(1)
    T, E, k = 40, 8, 2
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(T)]) + 1
    ids[:, 0] = 3  # expert 3 holds every token (3 tiles of 16 rows); experts 0 and 7 hold none
    ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    check(*make(T, E, k, 64, 32, dtype, gen, ids=ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_limit_clamps_gate_and_up(dtype):
    """DeepSeek-V4's clamped SwiGLU: gate <= limit, -limit <= up <= limit. Inputs scaled so that
    about half of the gate and up values lie beyond the limit (the clamp decides the result)."""
    gen = torch.Generator().manual_seed(7)
    x, w13, w2, weights, ids = make(9, 6, 2, 80, 48, dtype, gen)
    x = (x.float() * 4).to(dtype)
    limit = 1.5
    with poisoned_empty():
        y = fused_moe(x, w13, w2, weights, ids, swiglu_limit=limit)
    want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids, swiglu_limit=limit)
    plain = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert (want - plain).norm() > 0.1 * want.norm()  # the clamp is active
    assert_close(y, want, dtype)


def test_larger_block_m_and_tail_tiles():
    gen = torch.Generator().manual_seed(2)
    cfg = configs.MoEConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
    check(*make(9, 4, 2, 72, 40, torch.float32, gen), torch.float32, config=cfg)


def test_moe_align_layout():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]], dtype=torch.int32)  # pairs 0..5
    pairs, bexp = moe_align(ids, num_experts=4, block_m=4)
    P = 6
    # expert 0: pairs 1, 5; expert 1: pair 3; expert 2: pairs 0, 2, 4; expert 3: none
    assert pairs.tolist()[:12] == [1, 5, P, P, 3, P, P, P, 0, 2, 4, P]
    assert bexp.tolist()[:3] == [0, 1, 2]
    assert all(e == -1 for e in bexp.tolist()[3:])
    assert all(p == P for p in pairs.tolist()[12:])
    assert pairs.numel() == 4 * bexp.numel()


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = make(2, 4, 2, 32, 16, torch.float32, gen)
    with pytest.raises(ValueError, match="shapes"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="must match"):
        fused_moe(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"\[T=2, k\]"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def test_sm120_configs_fit_shared_memory():
    for rows_per_expert in (0.01, 1, 16, 17, 64, 1000):
        cfg = configs.moe_config(120, rows_per_expert)
        assert configs.moe_smem_bytes(cfg) <= configs.SMEM_LIMIT[120], cfg
        assert configs.moe_smem_bytes(configs.moe_config(90, rows_per_expert)) <= configs.SMEM_LIMIT[90]
    # what Triton 3.6 allocated on the H200: the estimate must not be below it
    assert configs.moe_smem_bytes(configs.MoEConfig(32, 64, 128, 4, 4)) >= 245760
    assert configs.moe_smem_bytes(configs.MOE_FP32) * 2 <= configs.SMEM_LIMIT[120]  # 4-byte tiles


@pytest.mark.parametrize(
    "T,E,k,block_m", [(1, 256, 8, 16), (1, 8, 2, 16), (3, 8, 2, 4), (40, 8, 2, 16), (128, 256, 8, 16), (5, 6, 3, 32)]
)
def test_one_program_align_matches_torch_align(T, E, k, block_m):
    gen = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    ids[: T // 2, 0] = 1  # one crowded expert
    ids = ids.to(DEVICE)
    with poisoned_empty():
        fast = moe_align_fast(ids, E, block_m)
    slow = moe_align(ids, E, block_m)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@pytest.mark.parametrize("S,T,k,hidden", [(1, 1, 6, 64), (3, 5, 3, 1100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_pairs_sums_splits_and_pairs_once(S, T, k, hidden, dtype):
    """The MoE's last step in one launch: y[t] = sum over splits s and the token's pairs j of
    part[s, t*k + j], rounded once to x's dtype (to nearest, as torch's cast); hidden over one
    program's 1024 values, splits of a strided buffer (rows of a wider one)."""
    gen = torch.Generator().manual_seed(seed_of("sum_pairs", S, T, k, hidden, str(dtype)))
    part = torch.randn(S + 1, T * k, hidden, generator=gen, dtype=torch.float64)[1:]
    with poisoned_empty():
        y = sum_pairs(part.float().to(DEVICE), k, dtype)
    want = part.float().double().view(S, T, k, hidden).sum((0, 2))
    assert y.shape == (T, hidden) and y.dtype == dtype and not y.isnan().any()
    assert_close(y.double().cpu(), want.to(dtype).double(), dtype)
    if dtype != torch.float32:  # rounded once, to nearest: bit for bit but at float32 sum-order ties
        assert (y.cpu() != want.to(dtype)).float().mean() < 0.01
    with pytest.raises(ValueError, match="sum_pairs"):
        sum_pairs(part.float().to(DEVICE).transpose(1, 2), k, dtype)
