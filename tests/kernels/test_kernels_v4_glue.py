"""DeepSeek-V4's fused per-layer glue (kernels/mhc.py, kernels/glue.py) against the PyTorch code the
model ran before them (kernels/ref_glue.py, itself checked against transformers' modules here and in
test_kernels_hyper.py), on seeded random inputs of odd sizes, outputs poisoned with NaN.

The kernels round where PyTorch rounds (a bf16 model's scores, norm scales, products) and differ from
it only in float32 (another summation order, exp, rsqrt: a few float32 ulps), which can put a value
across a rounding boundary: each low-precision output is within the roundings on its path, counted
on both sides (`close_within`), and at least 99% of them equal bit for bit.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels import ref_glue as ref  # noqa: E402
from pdserve_kernels.glue import rms_norm_rope, route, swiglu  # noqa: E402
from pdserve_kernels.mhc import hc_post, hc_pre  # noqa: E402
from tests.helpers.kernels import (  # noqa: E402
    DEVICE,
    U,
    close_within,
    mostly_equal,
    require_interpreter,
    rope_terms,
    seed_of,
)

pytestmark = pytest.mark.timeout(600)
require_interpreter()
LOW = [torch.bfloat16, torch.float16]
# route's weights, per side: the softplus rounded (U), its sqrt (U / 2 of it, + U), the sum of the k
# scores (1.5 U + U; its + 1e-20 is exact), score / sum (1.5 U + 2.5 U + U), times scaling (+ U): 6 U;
# sigmoid: the score (U), the sum (2 U), the division (4 U), the scaling (5 U). Both sides:
ROUTE_ROUNDINGS = {"sqrtsoftplus": 12, "sigmoid": 10}


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs the wrappers allocate start as NaN (ints: a sentinel): an element a kernel does not
    write fails the test."""
    new_empty, empty, empty_like = torch.Tensor.new_empty, torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else 2**30 - 1)

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: fill(new_empty(self, *a, **kw)))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*parts))


def _dev(*ts):
    return [t.to(DEVICE) if t is not None else None for t in ts]


def _hc_input_close(got: torch.Tensor, want: torch.Tensor, h, fn, base, scale, w) -> None:
    """hc_pre's block input. The collapse sum_n pre_n h_n is rounded to h's dtype on each side: 2 U.
    Normed (w), that rounding enters again through 1 / rms (half of its squares' 2 U) and the output
    is rounded: 3 U a side, 6 U. Before the rounding, the float32 pre gates differ by up to the gates'
    tolerance (F32 pre + 1e-5 <= 2e-5, as post's), times the streams they weight (times w / rms)."""
    inner = 2e-5 * h.double().abs().sum(1)
    if w is not None:
        c = ref.hc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6)[2].double()
        inner = inner * w.double().abs() * torch.rsqrt(c.square().mean(-1, keepdim=True) + 1e-5)
    close_within(got, want, h.dtype, "input", 6 if w is not None else 2, inner)


def _rows_of_a_neighbouring_scale(got: torch.Tensor, x: torch.Tensor, eps: float) -> None:
    """layers.rms_norm rounds its scale rsqrt(mean x^2) to x's dtype before the product: each row of
    got is x times PyTorch's rounded scale or one of its two neighbours (the float32 rsqrt across a
    rounding boundary), bit for bit."""
    s = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    inf = torch.full_like(s, float("inf"))
    rows = [(got == x * t).all(-1) for t in (torch.nextafter(s, -inf), s, torch.nextafter(s, inf))]
    assert torch.stack(rows).any(0).all(), "a row is not x times PyTorch's rounded scale or a neighbour"


@pytest.mark.parametrize("T,N,D", [(1, 4, 72), (19, 4, 200), (33, 2, 37), (5, 8, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_hc_pre_matches_the_module(T, N, D, dtype, norm, poisoned):
    g = _gen("hc_pre", T, N, D, dtype, norm)
    M = (2 + N) * N
    h = torch.randn(T, N, D, generator=g).to(dtype)
    fn, base = 0.2 * torch.randn(M, N * D, generator=g), 0.5 * torch.randn(M, generator=g)
    scale, w = 1 + torch.rand(3, generator=g), (1 + 0.2 * torch.randn(D, generator=g)) if norm else None
    got = hc_pre(*_dev(h, fn, base, scale), 20, 1e-6, 1e-6, *_dev(w), 1e-5)
    want = ref.hc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)
    for name, a, b in zip(("post", "comb"), got, want):
        close_within(a, b, torch.float32, name)
    _hc_input_close(got[2], want[2], h, fn, base, scale, w)
    if norm:  # stage by stage, one rounding a side each: the kernel's collapse (no norm), and its
        # normed output against PyTorch's norm of that same collapse
        collapsed = hc_pre(*_dev(h, fn, base, scale), 20, 1e-6, 1e-6)[2].cpu()
        want_collapsed = ref.hc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6)[2]
        _hc_input_close(collapsed, want_collapsed, h, fn, base, scale, None)
        mostly_equal(collapsed, want_collapsed)
        normed = ref.rms_norm_ref(collapsed, w, 1e-5)
        close_within(got[2], normed, dtype, "norm of the collapse")
        mostly_equal(got[2].cpu(), normed)


def test_hc_pre_of_one_token_is_one_launch_and_replays(poisoned, monkeypatch):
    """A one-token step (mhc.FUSE_T): the projection's last split to arrive runs the pre-mix, so
    `_hc_pre` is not launched; its arrival counter is zero again, so a second call (a graph
    replay) is right too."""
    from pdserve_kernels import _launch, mhc

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("_hc_pre launched for one token")

    monkeypatch.setattr(mhc, "_hc_pre", NotLaunched())
    g, N, D = _gen("hc_pre_one"), 4, 72
    fn, base = 0.2 * torch.randn(24, N * D, generator=g), 0.5 * torch.randn(24, generator=g)
    scale, w = 1 + torch.rand(3, generator=g), 1 + 0.2 * torch.randn(D, generator=g)
    for _ in range(2):
        h = torch.randn(1, N, D, generator=g).to(torch.bfloat16)
        got = hc_pre(*_dev(h, fn, base, scale), 20, 1e-6, 1e-6, *_dev(w), 1e-5)
        want = ref.hc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)
        for name, a, b in zip(("post", "comb"), got, want):
            close_within(a, b, torch.float32, name)
        _hc_input_close(got[2], want[2], h, fn, base, scale, w)
    assert not _launch.arrival_counters(torch.device(DEVICE), 1, "test").any()


@pytest.mark.parametrize("T,N,D", [(1, 4, 64), (7, 4, 45)])
def test_hc_pre_of_the_head_has_pre_gates_only(T, N, D, poisoned):
    g = _gen("head", T, N, D)
    h, fn = torch.randn(T, N, D, generator=g), 0.2 * torch.randn(N, N * D, generator=g)
    base, scale, w = torch.randn(N, generator=g), torch.rand(1, generator=g), 1 + torch.rand(D, generator=g)
    post, comb, x = hc_pre(*_dev(h, fn, base, scale), 0, 1e-6, 1e-6, *_dev(w), 1e-6)
    assert post is None and comb is None
    close_within(x, ref.hc_pre_ref(h, fn, base, scale, 0, 1e-6, 1e-6, w, 1e-6)[2], torch.float32, "head")


@pytest.mark.parametrize("T,N,D", [(1, 4, 64), (6, 4, 301), (9, 2, 37), (3, 8, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("two", [False, True])
def test_hc_post_matches_the_residual(T, N, D, dtype, two, poisoned):
    """two: the block's output in two parts (the MoE's routed and shared experts), added in the kernel."""
    g = _gen("hc_post", T, N, D, dtype, two)
    h, out = torch.randn(T, N, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)
    post, comb = 2 * torch.rand(T, N, generator=g), torch.rand(T, N, N, generator=g)
    out2 = torch.randn(T, D, generator=g).to(dtype) if two else None
    got = hc_post(*_dev(h, out, post, comb, out2)).cpu()
    want = ref.hc_post_ref(h, out + out2 if two else out, post, comb)
    # post * out: a product of two values of dtype, exact in float32 and rounded alike on both
    # sides; comb^T @ h: float32 sums in another order, rounded on each side (2 U |comb^T h|, which
    # the sum with post * out may cancel); the sum rounded on each side (2 U |want|)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), h).double().abs()
    close_within(got, want, dtype, "streams", 2, 2 * U[dtype] * mixed)
    mostly_equal(got, want)  # rounded where PyTorch rounds: the products, the matmul, their sum


@pytest.mark.parametrize("shape,R", [((3, 5, 38), 16), ((7, 74), 8), ((1, 3, 512), 64), ((4, 2, 6), 6)])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("what", ["norm", "weighted", "rope", "weighted+rope"])
def test_rms_norm_rope_matches_the_modules(shape, R, dtype, what, poisoned):
    g = _gen("norm_rope", shape, R, dtype, what)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    cos, sin = torch.randn(shape[0], R // 2, generator=g), torch.randn(shape[0], R // 2, generator=g)
    w = 1 + 0.3 * torch.randn(shape[-1], generator=g) if "weighted" in what else None
    rope = (cos, sin) if "rope" in what else None
    got = rms_norm_rope(*_dev(x, w), 1e-6, norm=what != "rope", rope=_dev(*rope) if rope else None).cpu()
    normed = x if what == "rope" else ref.rms_norm_ref(x, w, 1e-6)
    want = ref.rope_tail_ref(normed, cos, sin) if rope else normed
    if what == "norm":  # the scale rounded (U), the product rounded (U), on each side
        close_within(got, want, dtype, what, 4)
        if dtype != torch.float32:
            _rows_of_a_neighbouring_scale(got, x, 1e-6)
    else:  # one rounding a side; weighted+rope: the normed values' (U a side) through the rotation
        inner = 2 * U[dtype] * rope_terms(normed, cos, sin) if what == "weighted+rope" else None
        close_within(got, want, dtype, what, 2, inner)
        mostly_equal(got, want, 2 if rope else 1)


def test_rms_norm_rope_reads_a_strided_row():
    g = _gen("strided")
    buf = torch.randn(5, 3, 40, generator=g)
    x = buf[:, :, :32]  # rows of 32 in a buffer of 40
    cos, sin = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    got = rms_norm_rope(*_dev(x), None, 1e-6, rope=_dev(cos, sin)).cpu()
    torch.testing.assert_close(got, ref.rope_tail_ref(ref.rms_norm_ref(x, None, 1e-6), cos, sin), rtol=2e-6, atol=1e-6)
    # heads of a joined GEMM's output slice: token stride 100, not heads x 32
    x = torch.randn(5, 100, generator=g)[:, :96].view(5, 3, 32)
    got = rms_norm_rope(*_dev(x), None, 1e-6, rope=_dev(cos, sin)).cpu()
    torch.testing.assert_close(got, ref.rope_tail_ref(ref.rms_norm_ref(x, None, 1e-6), cos, sin), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("T,D,R,N", [(1, 38, 16, 5), (7, 74, 8, 19), (3, 512, 64, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_rms_norm_rope_stores_its_rows_and_rotates_back(T, D, R, N, dtype, poisoned):
    """store: the rows also into pool records (as index_copy_ after it), the rest untouched;
    inverse: the rotation by -angle (the un-rope of V4's attention output, which negated sin)."""
    g = _gen("norm_store", T, D, R, N, dtype)
    x, w = (3 * torch.randn(T, D, generator=g)).to(dtype), 1 + 0.3 * torch.randn(D, generator=g)
    cos, sin = torch.randn(T, R // 2, generator=g), torch.randn(T, R // 2, generator=g)
    region, rows = torch.randn(N, D, generator=g).to(dtype), torch.randperm(N, generator=g)[:T]
    want_region = region.clone()
    normed = ref.rms_norm_ref(x, w, 1e-6)
    want = ref.rope_tail_ref(normed, cos, sin)
    want_region.index_copy_(0, rows, want)
    region_dev = region.to(DEVICE)
    got = rms_norm_rope(*_dev(x, w), 1e-6, rope=_dev(cos, sin), store=(region_dev, rows.to(DEVICE))).cpu()
    close_within(got, want, dtype, "rows", 2, 2 * U[dtype] * rope_terms(normed, cos, sin))  # as weighted+rope
    assert torch.equal(region_dev.cpu(), want_region.index_copy(0, rows, got)), "stored rows, or untouched rows"
    back = rms_norm_rope(*_dev(x), None, 0.0, norm=False, rope=_dev(cos, sin), inverse=True).cpu()
    want = ref.rope_tail_ref(x, cos, -sin)
    close_within(back, want, dtype, "inverse")
    mostly_equal(back, want)


def _logits(g, T, E, dtype):
    x = 3 * torch.randn(T, E, generator=g)
    x[0, :3] = torch.tensor([25.0, -30.0, -90.0])  # softplus past its threshold, and its tiny tail
    return x.to(dtype)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 37, 3), (9, 256, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_route_topk_matches_the_router(T, E, k, dtype, scoring, poisoned):
    g = _gen("route", T, E, k, dtype, scoring)
    logits, bias = _logits(g, T, E, dtype), 0.3 * torch.randn(E, generator=g)
    w, ids = route(*_dev(logits), k, scoring, 2.5, bias=bias.to(DEVICE))
    want_w, want_ids = ref.route_ref(logits, k, scoring, 2.5, bias=bias)
    ids, w = ids.cpu(), w.cpu()
    assert ids.dtype == torch.int64 and w.dtype == dtype
    order, want_order = ids.argsort(1), want_ids.argsort(1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order)), "the same experts"
    close_within(w.gather(1, order), want_w.gather(1, want_order), dtype, "weights", ROUTE_ROUNDINGS[scoring], atol=0)


def test_route_reads_the_logits_of_a_joined_gemm(poisoned):
    """The router's logits as the first E columns of one wider GEMM output (router and shared
    expert joined): strided rows give the same choice and weights as the contiguous logits."""
    g = _gen("route_joined")
    wide = _logits(g, 5, 37 + 64, torch.float32)
    bias = 0.3 * torch.randn(37, generator=g)
    got = route(*_dev(wide[:, :37]), 3, "sqrtsoftplus", 2.5, bias=bias.to(DEVICE))
    want = route(*_dev(wide[:, :37].contiguous()), 3, "sqrtsoftplus", 2.5, bias=bias.to(DEVICE))
    assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[0].cpu(), want[0].cpu())
    ref_w, ref_ids = ref.route_ref(wide[:, :37], 3, "sqrtsoftplus", 2.5, bias=bias)
    assert torch.equal(got[1].cpu().sort(1).values, ref_ids.sort(1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_ties_pick_the_lowest_expert_ids(dtype):
    """Equal scores + bias: the kernel takes the lowest ids (torch.topk leaves the choice open),
    in descending order of score + bias; the weights are those of any valid choice."""
    T, E, k = 4, 40, 6
    logits = torch.zeros(T, E)
    logits[1, 10:20] = 1.0  # ten tied at the top
    logits[2, ::3] = 2.0  # a tie across the whole row
    logits[3, 30:] = 0.5
    logits[3, 31] = 0.75
    bias = torch.zeros(E)
    bias[5] = 0.25  # row 0: one above, the rest tied
    w, ids = route(logits.to(dtype).to(DEVICE), k, "sqrtsoftplus", 1.5, bias=bias.to(DEVICE))
    scores = ref.route_ref(logits.to(dtype), k, "sqrtsoftplus", 1.5, bias=bias)[0]
    key = ref.F.softplus(logits.to(dtype)).sqrt().float() + bias
    stable = torch.sort(-key, dim=1, stable=True).indices[:, :k]  # descending, ties by lowest id
    assert torch.equal(ids.cpu(), stable)
    close_within(
        w.cpu().sort(1).values, scores.sort(1).values, dtype, "weights", ROUTE_ROUNDINGS["sqrtsoftplus"], atol=0
    )


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (11, 37, 3), (5, 256, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_hash_matches_the_router(T, E, k, dtype, poisoned):
    g = _gen("hash", T, E, k, dtype)
    logits, vocab = _logits(g, T, E, dtype), 50
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)])
    table[3] = table[3, :1].expand(k)  # a row naming one expert k times: its weight k times
    input_ids = torch.randint(vocab, (T,), generator=g)
    input_ids[0] = 3
    w, ids = route(*_dev(logits), k, "sqrtsoftplus", 2.5, table=table.to(DEVICE), input_ids=input_ids.to(DEVICE))
    want_w, want_ids = ref.route_ref(logits, k, "sqrtsoftplus", 2.5, table=table, input_ids=input_ids)
    assert torch.equal(ids.cpu(), want_ids), "the table's rows, in their order"
    close_within(w.cpu(), want_w, dtype, "weights", ROUTE_ROUNDINGS["sqrtsoftplus"], atol=0)


def test_route_refuses_what_it_cannot_do():
    logits = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="scoring"):
        route(logits, 2, "softmax", 1.0, bias=torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="either a bias or a hash table"):
        route(logits, 2, "sigmoid", 1.0)
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        route(logits, 9, "sigmoid", 1.0, bias=torch.zeros(8, device=DEVICE))


def test_swiglu_reads_the_halves_of_one_gemm(poisoned):
    """gate and up as the two halves of one [T, 2I] output (a joined bf16 GEMM): strided rows."""
    g = _gen("swiglu_halves")
    y = (6 * torch.randn(5, 2 * 1031, generator=g)).to(torch.float16)
    got = swiglu(*_dev(y[:, :1031], y[:, 1031:]), 4.0).cpu()
    want = ref.swiglu_ref(y[:, :1031], y[:, 1031:], 4.0)
    close_within(got, want, torch.float16, "swiglu halves", 4)  # silu rounded, the product rounded: 2 U a side
    mostly_equal(got, want)


@pytest.mark.parametrize("shape", [(1, 64), (7, 33), (3, 5, 1031)])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_swiglu_matches_the_shared_expert(shape, dtype, poisoned):
    g = _gen("swiglu", shape, dtype)
    gate, up = (6 * torch.randn(*shape, generator=g)).to(dtype), (6 * torch.randn(*shape, generator=g)).to(dtype)
    got = swiglu(*_dev(gate, up), 4.0).cpu()
    want = ref.swiglu_ref(gate, up, 4.0)
    close_within(got, want, dtype, "swiglu", 4)  # silu rounded, the product rounded: 2 U a side
    mostly_equal(got, want)
