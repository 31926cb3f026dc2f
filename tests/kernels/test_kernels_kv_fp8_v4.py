"""DeepSeek-V4's FP8 KV pages ("fp8_ds_v4", kernels/kv_fp8.py) and the sparse decode kernel that
reads them, against float64 references. On CPU the kernel runs under the Triton interpreter (see
test_kernels_sparse_mla.py's docstring); fp16 stands in for bf16 there (triton issue 11584).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import _launch, configs, kv_fp8, ref  # noqa: E402
from pdserve_kernels.sparse_mla import paged_mla_decode_fp8_v4, sparse_mla_decode_fp8_v4  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, assert_close, poisoned_empty, require_interpreter, seed_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def test_record_bytes():
    rec = kv_fp8.V4_FLASH
    assert (rec.nope, rec.value_bytes, rec.scale_bytes, rec.bytes) == (448, 576, 8, 584)
    assert kv_fp8.V4Record(64, 16).bytes == 48 + 32 + 8  # the tiny model: one scale, 7 pad bytes
    assert kv_fp8.pack_kv_fp8_v4(torch.randn(130, 512), page=64).shape == (3, 64, 584)
    with pytest.raises(ValueError, match="multiple of 16"):
        kv_fp8.V4Record(512, 60)


def test_bytes_are_flashmla_page_order():
    """Hand-made values with known bytes, read at the offsets the layout names: record r of a
    page of P at [r * 576, ...) (448 e4m3 then 64 bf16), its scales at [P * 576 + r * 8, ...)."""
    P, r = 4, 2
    kv = torch.zeros(P, 512)
    for g in range(7):
        kv[r, g * 64] = 448.0 * 2.0 ** (g - 3)  # group amax 448 * 2^k: scale byte 127 + k, e4m3 448 = 0x7E
        kv[r, g * 64 + 1] = -(2.0 ** (g - 3))  # e4m3 -1.0 = 0xB8
    kv[r, 448:] = torch.arange(64) - 31.5  # exact in bf16
    page = kv_fp8.pack_kv_fp8_v4(kv, page=P)[0].reshape(-1)  # [P * 584] bytes
    vals, scales = page[r * 576 : (r + 1) * 576], page[P * 576 + r * 8 : P * 576 + (r + 1) * 8]
    assert scales.tolist() == [124, 125, 126, 127, 128, 129, 130, 0]
    assert all(vals[g * 64].item() == 0x7E and vals[g * 64 + 1].item() == 0xB8 for g in range(7))
    assert not vals[2:64].any()
    assert torch.equal(vals[448:].view(torch.bfloat16).float(), kv[r, 448:])
    assert page[P * 576 :].view(P, 8)[0, :7].tolist() == [114] * 7  # zero groups: scale floor 1e-4 -> 2^-13


@pytest.mark.parametrize("dim, rope", [(512, 64), (64, 16), (80, 16)])
def test_roundtrip_within_e4m3_and_ue8m0_rounding(dim, rope):
    gen = torch.Generator().manual_seed(dim)
    kv = torch.randn(50, dim, generator=gen) * torch.logspace(-6, 3, 50)[:, None]
    kv[3, :] = 0.0
    rec = kv_fp8.V4Record(dim, rope)
    pages = kv_fp8.pack_kv_fp8_v4(kv, page=8, rec=rec)
    back = kv_fp8.unpack_kv_fp8_v4(pages, rec)[:50]
    torch.testing.assert_close(back[:, rec.nope :], kv[:, rec.nope :].bfloat16().float(), rtol=0, atol=0)
    scales = pages.reshape(-1, 8 * rec.bytes)[:, 8 * rec.value_bytes :].reshape(-1, rec.scale_bytes)[:50, : rec.groups]
    scale = torch.ldexp(torch.ones(50, rec.groups), scales.int() - 127)  # powers of two by construction
    nope = torch.nn.functional.pad(kv[:, : rec.nope], (0, rec.groups * 64 - rec.nope)).view(50, rec.groups, 64)
    need = (nope.abs().amax(-1) / 448).clamp(min=1e-4)
    assert (scale >= need).all() and (scale < 2 * need).all()  # the smallest power of two >= amax / 448
    # e4m3: 3 mantissa bits (relative half-ulp 2^-4) down to 2^-6, then steps of 2^-9 (times the scale)
    err = (back[:, : rec.nope] - kv[:, : rec.nope]).abs()
    bound = torch.maximum(kv[:, : rec.nope].abs() * 2.0**-4, scale.repeat_interleave(64, 1)[:, : rec.nope] * 2.0**-10)
    assert (err <= bound).all()
    assert not back[3].any()


# (T, H, D, rope, P, pages, W, E): T queries of H heads, D = dim of a record, P records per page,
# W window + E entry slots per query as the model builds them. V4-Flash (64 heads; 16 per TP4
# rank) with pool pages (P 64, 16) and flat records (P 1); odd H below and above a head block,
# the tiny model's 64 = 48 + 16, a partial scale group (80 = 64 + 16), an odd page size.
V4_SHAPES = [
    (1, 64, 512, 64, 64, 3, 8, 24),
    (3, 64, 512, 64, 1, 150, 8, 12),
    (4, 16, 512, 64, 16, 10, 6, 10),
    (3, 7, 64, 16, 8, 12, 5, 9),
    (2, 33, 80, 16, 3, 40, 8, 20),
]


def v4_indices(T, W, E, N, gen):
    """[T, 1, W + E] int32 slot ids: leading window padding, trailing entry padding, -1 anywhere,
    and (T > 1) a last query that reads nothing."""
    idx = torch.randint(0, N, (T, W + E), generator=gen, dtype=torch.int32)
    for t in range(T):
        idx[t, : (t * 3) % W] = -1
        idx[t, W + E - (t * 5) % E - 1 :] = -1
    idx[torch.rand(T, W + E, generator=gen) < 0.2] = -1
    if T > 1:
        idx[-1] = -1
    return idx[:, None].to(DEVICE)


def check(out, lse, want, want_lse, dtype):
    assert out.dtype == dtype and out.shape == want.shape and lse.shape == want_lse.shape
    assert_close(out, want, dtype)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", V4_SHAPES)
def test_kernel_matches_reference(shape, dtype):
    T, H, D, rope, P, Nb, W, E = shape
    gen = torch.Generator().manual_seed(seed_of(shape, str(dtype)))
    rec = kv_fp8.V4Record(D, rope)
    pool = torch.zeros(Nb, P * rec.bytes + 16, dtype=torch.uint8)  # a padded page stride (FlashMLA pads too)
    pool[:, : P * rec.bytes] = kv_fp8.pack_kv_fp8_v4(torch.randn(Nb * P, D, generator=gen), P, rec).view(Nb, -1)
    pages = pool.to(DEVICE)[:, : P * rec.bytes].unflatten(1, (P, rec.bytes))
    q = torch.randn(T, 1, H, D, generator=gen).to(DEVICE, dtype)
    idx = v4_indices(T, W, E, Nb * P, gen)
    sink = (2 * torch.randn(H, generator=gen)).to(DEVICE)  # float32, as the model keeps it
    scale = D**-0.5
    with poisoned_empty():
        out, lse = sparse_mla_decode_fp8_v4(q, pages, idx, scale, rope, sink=sink)
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_v4_ref(q.double(), pages, idx, scale, rope, sink=sink.double())
    check(out, lse, want, want_lse, dtype)
    if T > 1:  # nothing to read: zero output, all the mass on the sink
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        torch.testing.assert_close(lse[-1, 0], sink.float())


@pytest.mark.parametrize("fused_merge", [True, False])
def test_many_splits_without_sinks(fused_merge):
    """13 splits of one 16-row tile, 2 head blocks, S = 2, an all-padding query: lse -inf there."""
    cfg = configs.MLAConfig(
        block_h=16, block_n=16, num_warps=4, num_stages=1, waves=8, min_tiles=1, fused_merge=fused_merge
    )
    gen = torch.Generator().manual_seed(5)
    pages = kv_fp8.pack_kv_fp8_v4(torch.randn(96, 64, generator=gen) * 3, 32, kv_fp8.V4Record(64, 16)).to(DEVICE)
    q = torch.randn(2, 2, 20, 64, generator=gen).to(DEVICE)
    idx = torch.randint(0, 96, (2, 2, 200), generator=gen, dtype=torch.int32)
    idx[:, :, ::3] = -1
    idx[1, 0] = -1
    idx = idx.to(DEVICE)
    with poisoned_empty():
        out, lse = sparse_mla_decode_fp8_v4(q, pages, idx, 0.125, 16, config=cfg)
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_v4_ref(q.double(), pages, idx, 0.125, 16)
    check(out, lse, want, want_lse, torch.float32)
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0])) and torch.isneginf(lse[1, 0]).all()
    if fused_merge:
        assert not _launch._COUNTERS[q.device].any()


def test_paged_mode_matches_reference():
    """Dense decode over the block table: block b of the table is page b of the pool."""
    gen = torch.Generator().manual_seed(9)
    P, Nb, H, D = 8, 12, 16, 512
    pages = kv_fp8.pack_kv_fp8_v4(torch.randn(Nb * P, D, generator=gen), P).to(DEVICE)
    tables = torch.randperm(Nb, generator=gen)[:10].view(2, 5).to(torch.int32).to(DEVICE)
    seq_ids = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([37, 0, 19], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, H, D, generator=gen).to(DEVICE, torch.float16)
    sink = torch.randn(H, generator=gen).to(DEVICE)
    with poisoned_empty():
        out, lse = paged_mla_decode_fp8_v4(q, pages, tables, seq_ids, lens, 40, D**-0.5, sink=sink)
    idx = ref.paged_slots(tables, seq_ids, lens, P, 40)[:, None]
    want, want_lse = kv_fp8.sparse_mla_decode_fp8_v4_ref(q.double(), pages, idx, D**-0.5, sink=sink.double())
    check(out, lse, want, want_lse, torch.float16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("page", [1, 4])
def test_gathered_records_read_the_same(page):
    """gather_kv_fp8_v4 (copies of some slots, in pages of 1 or 4) gives the kernel the same keys
    as the pool."""
    gen = torch.Generator().manual_seed(2)
    pages = kv_fp8.pack_kv_fp8_v4(torch.randn(64, 512, generator=gen), 16)
    slots = torch.randint(0, 64, (30,), generator=gen)
    flat = kv_fp8.gather_kv_fp8_v4(pages, slots, page=page)
    assert flat.shape == (-(-30 // page), page, 584)
    assert torch.equal(kv_fp8.unpack_kv_fp8_v4(flat)[:30], kv_fp8.unpack_kv_fp8_v4(pages)[slots])
    q = torch.randn(1, 1, 16, 512, generator=gen).to(DEVICE, torch.float16)
    idx = torch.arange(30, dtype=torch.int32, device=DEVICE).view(1, 1, 30)
    out_flat, _ = sparse_mla_decode_fp8_v4(q, flat.to(DEVICE), idx, 0.05)
    out_pool, _ = sparse_mla_decode_fp8_v4(q, pages.to(DEVICE), slots.to(torch.int32).to(DEVICE).view(1, 1, 30), 0.05)
    torch.testing.assert_close(out_flat, out_pool, rtol=0, atol=0)


def test_rejects_bad_inputs():
    q = torch.randn(1, 1, 16, 512, device=DEVICE, dtype=torch.float16)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEVICE)
    pages = torch.zeros(2, 4, 584, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="584"):
        sparse_mla_decode_fp8_v4(q, pages.view(2, 4 * 584), idx, 0.1)
    with pytest.raises(ValueError, match=r"\[Nb, P, 584\]"):  # V3.2's record size
        sparse_mla_decode_fp8_v4(q, torch.zeros(2, 4, 656, dtype=torch.uint8, device=DEVICE), idx, 0.1)
    with pytest.raises(ValueError, match="16-byte"):
        sparse_mla_decode_fp8_v4(
            q, torch.zeros(2 * 4 * 584 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(2, 4, 584), idx, 0.1
        )
    with pytest.raises(ValueError, match="sink"):
        sparse_mla_decode_fp8_v4(q, pages, idx, 0.1, sink=torch.zeros(3, device=DEVICE))


def test_sm120_config_fits_shared_memory():
    for heads in (16, 64):
        cfg = configs.mla_config(120, "fp8_v4", heads, 1, has_tail=False)
        assert configs.mla_smem_bytes(cfg, 512, 16, "fp8_v4") <= configs.SMEM_LIMIT[120]
