"""The FP4 fused MoE on experts in the fragment layout (`frag_experts`, made once at load: each
thread's bytes its warpgroup-MMA operand) against the float64 reference on the checkpoint's bytes,
and the layout itself: it round-trips to the checkpoint, and every code sits in the thread, word
and bits the MMA fragment and the kernel's unpack say.

Runs under the Triton interpreter without CUDA (the portable unpack of the same bits, fp32 / fp16
x: the interpreter's bf16 dot is wrong); on a GPU the same tests run compiled, bf16 through the
inline-PTX unpack.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import configs, ref_fp4  # noqa: E402
from pdserve_kernels.fused_moe_fp4 import frag_experts, fused_moe_fp4  # noqa: E402
from tests.helpers.kernels import DTYPES, REL_TOL, poisoned_empty, rel_err, require_interpreter, seed_of  # noqa: E402
from tests.kernels.test_kernels_moe_fp4 import SHAPES, make  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def random_packed(lead, N, K, gen, lo=100, hi=140):
    packed = torch.randint(0, 256, (*lead, N, K // 2), dtype=torch.uint8, generator=gen)
    return packed, torch.randint(lo, hi, (*lead, N, -(-K // 32)), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("N, K", [(64, 128), (70, 200), (128, 256), (5, 66)])
def test_frag_layout_round_trips_to_the_checkpoint(N, K):
    gen = torch.Generator().manual_seed(seed_of("frag rt", N, K))
    packed, scale = random_packed((3,), N, K, gen)
    values, scales = ref_fp4.frag_fp4(packed, scale)
    assert values.shape == (3, -(-N // 64), -(-K // 128), 4096) and scales.shape == (*values.shape[:-1], 256)
    back, back_s = ref_fp4.unfrag_fp4(values, scales, N, K)
    assert torch.equal(back, packed) and torch.equal(back_s, scale)


def test_frag_codes_sit_where_the_mma_fragment_wants_them():
    """An oracle written from the PTX warpgroup-MMA A-fragment (bf16, m64k16), not from the
    packing code: row r, column k of a tile is thread 32 (r // 16) + 4 (r % 8) + (k % 8) // 2,
    in its word of 16-column step k // 16 (half k // 64), element 4 c + 2 h + p with c = k % 16 >= 8,
    h = r % 16 >= 8, p = k % 2, at the bits `ref_fp4.FRAG_BITS` name; the scale of row r, group g
    sits at byte 8 (8 (r // 16) + r % 8) + 2 g + h."""
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_packed((), 64, 128, gen)
    codes = ref_fp4.unpack_fp4(packed)  # [64, 128]
    values, scales = (t.reshape(-1).long() for t in ref_fp4.frag_fp4(packed, scale))
    r, k = torch.meshgrid(torch.arange(64), torch.arange(128), indexing="ij")
    t = 32 * (r // 16) + 4 * (r % 8) + (k % 8) // 2
    ks, h, c, p = k // 16, (r % 16) // 8, (k % 16) // 8, k % 2
    word_at = ((ks // 4) * 128 + t) * 16 + (ks % 4) * 4
    word = sum(values[word_at + i] << (8 * i) for i in range(4))
    bits = torch.tensor(ref_fp4.FRAG_BITS)[4 * c + 2 * h + p]  # [64, 128, 4]
    got = sum(((word >> bits[..., j]) & 1) << j for j in range(4))
    assert torch.equal(got, codes.long())
    g = torch.arange(4)
    at = (
        8 * (8 * (torch.arange(64) // 16) + torch.arange(64) % 8)[:, None]
        + 2 * g
        + ((torch.arange(64) % 16) // 8)[:, None]
    )
    assert torch.equal(scales[at], scale.long())


def test_frag_unpack_bits_give_each_code_times_two_to_the_minus_126():
    """The kernel's unpack (`fused_moe_fp4_frag._dq_frag`) in integer torch: word & M, word << 3,
    word << 6 and the three-shift fourth pair give bf16 bit patterns of every code in every slot,
    the code's value times 2**-126 (code 1 the bf16 subnormal 2**-127)."""
    m = 0x81C081C0
    for slot in range(8):
        codes = torch.zeros(16, 8, dtype=torch.uint8)
        codes[:, slot] = torch.arange(16)
        codes[:, (slot + 3) % 8] = torch.arange(16).flip(0)  # a neighbour, to catch bits that leak
        w = ref_fp4.frag_word(codes)
        outs = [w & m, (w << 3) & m, (w << 6) & m]
        outs.append(((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000))
        halves = torch.stack([torch.stack([o & 0xFFFF, (o >> 16) & 0xFFFF], -1) for o in outs], 1).reshape(16, 8)
        got = halves.to(torch.int16).view(torch.bfloat16).double() * 2.0**126
        want = ref_fp4.e2m1_table(torch.float64)[codes.long()]
        assert torch.equal(got, want), slot


def check_frag(x, q13, q2, s13, s2, weights, ids, limit=None, config=None):
    """The fragment kernels on `frag_experts` of the checkpoint weights vs the reference on those
    (scales clamped to the bf16 path's range, 2**1: `frag_experts` refuses larger ones)."""
    s13, s2 = s13.clamp(max=128), s2.clamp(max=128)
    w = frag_experts(q13, q2, s13, s2)
    with poisoned_empty():
        y = fused_moe_fp4(x, *w, weights, ids, swiglu_limit=limit, config=config)
    want = ref_fp4.fused_moe_fp4_ref(
        x.double(), q13, q2, s13, s2, weights.double(), ids, swiglu_limit=limit, act_dtype=x.dtype
    )
    assert y.dtype == x.dtype and y.shape == x.shape
    assert not y.isnan().any(), "NaN in the output: an element was not written"
    err = rel_err(y, want)
    assert err < REL_TOL[x.dtype], f"relative error {err:.2e} ({x.dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_frag_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(seed_of("frag", shape, str(dtype)))
    check_frag(*make(*shape, dtype, gen), limit=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_frag_all_experts_empty_but_one(dtype):
    gen = torch.Generator().manual_seed(9)
    T, E = 37, 8
    ids = torch.full((T, 1), 5)  # 3 blocks of 16 rows for expert 5; 7 experts hold nothing
    check_frag(*make(T, E, 1, 64, 32, dtype, gen, ids=ids))


@pytest.mark.parametrize("splits, block_n2", [(1, 64), (2, 128), (3, 256)])
def test_frag_split_k_and_w2_row_blocks(splits, block_n2):
    """Split K (uneven: hidden 328 = 2 x 128 + 72, a partial tile), w2 programs of 1, 2 or 4 row
    blocks (hidden 328: 6 blocks, so 4 falls back to 2)."""
    gen = torch.Generator().manual_seed(30 + splits)
    dtype = torch.float16 if splits == 2 else torch.float32
    cfg = configs.MoEConfig(16, 64, 128, 4, 1, block_n2, split_k=splits)
    check_frag(*make(5, 4, 2, 328, 96, dtype, gen), limit=0.5, config=cfg)


def test_frag_w2_takes_four_row_blocks():
    gen = torch.Generator().manual_seed(44)
    check_frag(*make(3, 4, 2, 256, 64, torch.float32, gen), config=configs.MoEConfig(16, 64, 128, 4, 1, 256))


def test_frag_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    x, q13, q2, s13, s2, tw, ids = make(2, 4, 2, 128, 64, torch.float32, gen)
    w13, w2, f13, f2 = frag_experts(q13, q2, s13.clamp(max=128), s2.clamp(max=128))
    with pytest.raises(ValueError, match="scale > 2"):
        frag_experts(q13, q2, s13, torch.full_like(s2, 129))
    with pytest.raises(ValueError, match="fragment shapes disagree"):
        fused_moe_fp4(x[:, :64], w13, w2, f13, f2, tw, ids)
    with pytest.raises(ValueError, match="fragment scales"):
        fused_moe_fp4(x, w13, w2, f13[..., :-1], f2, tw, ids)
    with pytest.raises(ValueError, match="fragment layout"):
        fused_moe_fp4(x, w13, w2[0], f13, f2, tw, ids)
