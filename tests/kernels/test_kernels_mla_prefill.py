"""MLA prefill attention (non-absorbed, causal, chunked over a cached prefix) against a float64
reference, and the reference against plain causal softmax attention.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import. Shapes are tiny and odd: head dims
that are not powers of two (masked), chunks not multiples of the tiles, prefixes of every kind.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels.mla_prefill import mla_prefill_attention  # noqa: E402
from pdserve_kernels.ref import mla_prefill_attention_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPES, assert_close, poisoned_empty, rel_err, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


def make_inputs(q_lens, prefixes, H, Dn, R, Dv, dtype, seed):
    """Random q / expanded K, V for sequences with the given chunk lengths and cached prefixes.
    k_nope and v are strided views of one [S, H, Dn + Dv] tensor, as kv_b_proj's output is."""
    gen = torch.Generator().manual_seed(seed)
    k_lens = [p + n for p, n in zip(prefixes, q_lens)]
    T, S = sum(q_lens), sum(k_lens)
    q = torch.randn(T, H, Dn + R, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(S, H, Dn + Dv, generator=gen).to(DEVICE, dtype)
    k_rope = torch.randn(S, R + 3, generator=gen).to(DEVICE, dtype)[:, :R]  # row stride > R
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, kv[..., :Dn], k_rope, kv[..., Dn:], cu_q, cu_k, max(q_lens), max(k_lens)


def run_both(args, dtype, scale=0.3):
    q, k_nope, k_rope, v, cu_q, cu_k, max_q, max_k = args
    with poisoned_empty():
        out, lse = mla_prefill_attention(q, k_nope, k_rope, v, cu_q, cu_k, max_q, scale, max_seqlen_k=max_k)
    up = [t.double() for t in (q, k_nope, k_rope, v)]
    want, want_lse = mla_prefill_attention_ref(*up, cu_q.cpu(), cu_k.cpu(), max_q, scale)
    return out, lse, want, want_lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens,prefixes,H,Dn,R,Dv",
    [
        ([37], [0], 3, 24, 8, 20),  # one whole prompt, odd dims
        ([5, 19, 1], [0, 23, 40], 2, 16, 8, 16),  # chunks after prefixes, a one-token chunk
        ([17, 9], [16, 3], 1, 12, 4, 24),  # prefix a multiple of the tile, one not
    ],
)
def test_prefill_matches_reference(q_lens, prefixes, H, Dn, R, Dv, dtype):
    args = make_inputs(q_lens, prefixes, H, Dn, R, Dv, dtype, seed=sum(q_lens) + H)
    out, lse, want, want_lse = run_both(args, dtype)
    assert_close(out, want, dtype)
    assert not lse.isnan().any()
    assert rel_err(lse, want_lse) < (1e-6 if dtype == torch.float32 else 2e-3)


def test_chunked_equals_whole_prompt():
    """Prefilling 29 tokens as chunks 11 + 18 (the second over an 11-token prefix) gives the
    same rows as one causal pass over all 29."""
    whole = make_inputs([29], [0], 2, 16, 8, 16, torch.float32, seed=7)
    q, k_nope, k_rope, v, *_ = whole
    out_whole, *_ = run_both(whole, torch.float32)
    cu_q = torch.tensor([0, 18], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 29], dtype=torch.int32, device=DEVICE)
    out_chunk, _ = mla_prefill_attention(q[11:], k_nope, k_rope, v, cu_q, cu_k, 18, 0.3, max_seqlen_k=29)
    assert rel_err(out_chunk, out_whole[11:]) < 1e-5


def test_reference_is_causal_softmax_attention():
    """With no prefix the reference is torch's own causal SDPA on K = [k_nope | k_rope]."""
    q, k_nope, k_rope, v, cu_q, cu_k, max_q, _ = make_inputs([13], [0], 3, 8, 4, 6, torch.float64, seed=3)
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, 3, -1)], -1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.5
    ).transpose(0, 1)
    out, _ = mla_prefill_attention_ref(q, k_nope, k_rope, v, cu_q.cpu(), cu_k.cpu(), max_q, 0.5)
    assert rel_err(out, want) < 1e-12


def test_bad_shapes_are_refused():
    q, k_nope, k_rope, v, cu_q, cu_k, max_q, _ = make_inputs([4], [0], 2, 8, 4, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not match"):
        mla_prefill_attention(q[..., :-1], k_nope, k_rope, v, cu_q, cu_k, max_q, 1.0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        mla_prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k_nope, k_rope, v, cu_q, cu_k, max_q, 1.0)


# ---------------------------------------------------------------- the model's expanded prefill


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    from pdserve.model.loader import load_model
    from pdserve.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-v3"), "deepseek_v3", seed=0)
    return load_model(path, dtype=torch.float32, progress=False)


def test_expanded_prefill_gives_the_absorbed_logits(tiny_v3, monkeypatch):
    """The whole tiny DeepSeek-V3 with prefill chunks in the expanded form (the engine's default:
    MLA._expanded, the torch reference on CPU) gives the logits of the absorbed form over the paged
    pool within 1e-4 (float32): two prompts, one prefilled in chunks of 5 over its cached prefix,
    batched together with a one-token step of the other (a decode row beside prefill rows)."""
    from pdserve.model.deepseek_v3.attention import MLA
    from tests.helpers.model import PagedHarness, Seq

    prompts = [[(7 * i + 3) % 250 + 1 for i in range(13)], [(5 * i + 1) % 250 + 1 for i in range(9)]]

    def run(expanded: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(MLA, "expand_prefill", expanded)
        monkeypatch.setattr(MLA, "absorb_chunks_up_to", 1)  # even short chunks expanded
        h = PagedHarness(tiny_v3, num_blocks=32, block_size=4, seed=1)
        seqs, out = [Seq(), Seq()], [[], []]
        plan = [[(0, prompts[0][:5]), (1, prompts[1])], [(0, prompts[0][5:10]), (1, [17])], [(0, prompts[0][10:])]]
        for step in plan:
            work = [(seqs[i], new) for i, new in step]
            for (i, _), logits in zip(step, h.step(work)):
                out[i].append(logits)
        return [torch.cat(o) for o in out]

    want, got = run(False), run(True)
    for w, g in zip(want, got):
        assert (g - w).abs().max().item() < 1e-4 * max(1.0, w.abs().max().item()), (g - w).abs().max()
