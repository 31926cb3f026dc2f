"""Speculative decoding's acceptance (pdserve/engine/spec_decode/rejection.py).

Greedy rows must give exactly the target's argmax continuation. Random rows must keep the target
distribution exactly: the target is a tiny-vocabulary distribution processed by the Sampler
itself (temperature, top_k, top_p as it applies them), many rows are verified at once, and a
chi-square test compares the emitted tokens with it at every position (the first token, the
token after an accepted draft, the bonus token). The same test rejects a plausible wrong sampler
(one that redraws from p instead of the residual after a rejection), so it can fail.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.rejection import accept_drafts
from pdserve.sampling_params import SamplingParams
from tests.helpers.kernels import seed_of

V, K, ROWS = 6, 2, 60_000
ALPHA = 1e-3  # a correct sampler fails one test in a thousand seeds; the seeds are fixed


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts [V] against probabilities [V] (tokens of probability 0 must
    not occur at all)."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a filtered token was emitted"
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def processed(raw: torch.Tensor, **params) -> torch.Tensor:
    """[K+1, V] logits after the Sampler's processing for a request with these params."""
    seq = Sequence(Request(request_id="r", prompt_token_ids=[2, 3], params=SamplingParams(**params)))
    return Sampler("cpu", 0, [1]).process(raw, [seq] * raw.shape[0])


def test_greedy_acceptance_is_the_argmax_continuation():
    g = torch.Generator().manual_seed(seed_of("greedy-accept"))
    N, k = 64, 3
    logits = torch.randn(N, k + 1, V * 5, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :k].clone()
    wrong_at = torch.randint(0, k + 1, (N,), generator=g)  # k: every draft right
    for n in range(N):
        if wrong_at[n] < k:
            drafts[n, wrong_at[n]] = (drafts[n, wrong_at[n]] + 1) % (V * 5)
    num = torch.randint(0, k + 1, (N,), generator=g)
    tokens, accepted = accept_drafts(logits, drafts, num, torch.ones(N, dtype=torch.bool), g)
    for n in range(N):
        a = min(int(wrong_at[n]), int(num[n]))
        assert int(accepted[n]) == a
        assert tokens[n, : a + 1].tolist() == target[n, : a + 1].tolist()
        assert (tokens[n, a + 1 :] == -1).all()


def _sample(x: torch.Tensor, drafts: list[int], seed: int, draft_probs=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = x[None].expand(ROWS, -1, -1)
    d = torch.tensor(drafts)[None].expand(ROWS, -1)
    num = torch.full((ROWS,), len(drafts))
    greedy = torch.zeros(ROWS, dtype=torch.bool)
    if draft_probs is not None:  # drafts drawn from q, row by row
        d = torch.multinomial(draft_probs, ROWS, replacement=True, generator=g).T  # [ROWS, K]
        draft_probs = draft_probs[None].expand(ROWS, -1, -1)
    tokens, _ = accept_drafts(logits, d.contiguous(), num, greedy, g, draft_probs)
    return tokens, d


def _check_positions(x: torch.Tensor, tokens: torch.Tensor, drafts: torch.Tensor, min_rows: int = 2_000) -> None:
    p = x.softmax(-1)
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V), p[0]) > ALPHA
    for j in range(1, K + 1):  # position j given the tokens before it were the drafts
        prefix = (tokens[:, :j] == drafts[:, :j]).all(dim=1)
        assert int(prefix.sum()) > min_rows
        assert chi_square_p(torch.bincount(tokens[prefix, j], minlength=V), p[j]) > ALPHA


@pytest.mark.parametrize(
    "params", [dict(temperature=0.8), dict(temperature=1.3, top_k=4), dict(temperature=0.7, top_p=0.85)]
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    g = torch.Generator().manual_seed(seed_of("dist", sorted(params.items())))
    x = processed(torch.randn(K + 1, V, generator=g) * 1.5, **params)
    drafts = [int(x[0].argmax()), int(x[1].argsort()[-2])]  # a likely and a less likely draft
    tokens, d = _sample(x, drafts, seed_of("draw", sorted(params.items())))
    _check_positions(x, tokens, d)


def test_rejection_sampling_with_a_draft_distribution():
    g = torch.Generator().manual_seed(seed_of("q"))
    x = processed(torch.randn(K + 1, V, generator=g), temperature=1.0, top_k=5)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)  # q puts mass where p has none, too
    tokens, d = _sample(x, [0] * K, seed_of("q-draw"), draft_probs=q)
    _check_positions(x, tokens, d)


def test_the_chi_square_check_rejects_a_sampler_that_ignores_the_residual():
    """The plausible bug: after a rejection, redraw from p (the draft can come back)."""
    g = torch.Generator().manual_seed(seed_of("wrong"))
    x = processed(torch.randn(K + 1, V, generator=g), temperature=1.0)
    p = x.softmax(-1)
    d0 = int(p[0].argmax())
    accept = torch.rand(ROWS, generator=g) < p[0, d0]
    redraw = torch.multinomial(p[0], ROWS, replacement=True, generator=g)
    wrong = torch.where(accept, d0, redraw)
    assert chi_square_p(torch.bincount(wrong, minlength=V), p[0]) < ALPHA


def test_mixed_greedy_and_random_rows_and_no_drafts():
    g = torch.Generator().manual_seed(seed_of("mixed"))
    logits = torch.randn(4, K + 1, V, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :K].clone()
    num = torch.tensor([2, 0, 2, 0])
    greedy = torch.tensor([True, True, False, False])
    tokens, accepted = accept_drafts(logits, drafts, num, greedy, g)
    assert tokens[0].tolist() == target[0].tolist() and int(accepted[0]) == 2
    assert tokens[1].tolist() == [int(target[1, 0]), -1, -1] and int(accepted[1]) == 0
    assert int(accepted[3]) == 0 and tokens[3, 1:].tolist() == [-1, -1] and 0 <= int(tokens[3, 0]) < V


def test_seeded_rows_keep_the_distribution_and_depend_on_their_seed_alone():
    g = torch.Generator().manual_seed(seed_of("seeded"))
    x = processed(torch.randn(K + 1, V, generator=g) * 1.5, temperature=0.9, top_k=5)
    rows = 20_000
    logits = x[None].expand(rows, -1, -1)
    drafts = torch.tensor([int(x[0].argmax()), int(x[1].argmax())])[None].expand(rows, -1).contiguous()
    num, greedy = torch.full((rows,), K), torch.zeros(rows, dtype=torch.bool)
    seeds = [(1000 + n, 3) for n in range(rows)]  # distinct seeds: independent rows
    tokens, _ = accept_drafts(logits, drafts, num, greedy, torch.Generator().manual_seed(1), seeds=seeds)
    _check_positions(x, tokens, drafts, min_rows=1_000)
    # the same seeds give the same tokens whatever the shared generator and the other rows do
    again, _ = accept_drafts(
        logits[:50], drafts[:50], num[:50], greedy[:50], torch.Generator().manual_seed(2), seeds=seeds[:50]
    )
    assert torch.equal(again, tokens[:50])


@pytest.mark.parametrize("logprobs", [None, 2])
def test_the_greedy_fast_path_equals_the_general_one(logprobs):
    """verify.sample on greedy rows without processing (one argmax, acceptance on the host) gives
    the tokens and logprobs of the general path (processed rows, accept_drafts), on logits with
    tied maxima, draft counts 0..3, drafts right up to a random position, and drafts outside the
    vocabulary (clamped, as accept_drafts does)."""
    from pdserve.engine.spec_decode import verify

    g = torch.Generator().manual_seed(seed_of("greedy-fast-path", logprobs))
    Vb, sampler = 11, Sampler("cpu", 0, [1])
    for trial in range(40):
        counts = torch.randint(0, 4, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        logits = torch.randint(-3, 3, (sum(counts) + len(counts), Vb), generator=g).float()  # ties
        target, seqs, row = logits.argmax(-1).tolist(), [], 0
        for i, n in enumerate(counts):
            params = SamplingParams(temperature=0.0, logprobs=logprobs)
            seq = Sequence(Request(request_id=f"r{i}", prompt_token_ids=[2, 3], params=params))
            wrong = int(torch.randint(0, n + 1, (1,), generator=g))
            drafts = target[row : row + n]
            drafts = [
                t if j < wrong else int(torch.randint(-2, Vb + 3, (1,), generator=g)) for j, t in enumerate(drafts)
            ]
            seq.spec_token_ids, row = drafts, row + n + 1
            seqs.append(seq)
        assert not sampler.changes_logits(seqs)
        fast = verify.sample(sampler, logits, seqs, counts)
        sampler.changes_logits = lambda seqs: True  # the general path: processed rows, accept_drafts
        general = verify.sample(sampler, logits, seqs, counts)
        del sampler.changes_logits
        assert fast == general, (trial, counts)
