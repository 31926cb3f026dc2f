import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams

V = 32
EOS = 1


def seqs(n: int, prompt=(2, 3), outputs=(), **params) -> list[Sequence]:
    out = []
    for i in range(n):
        s = Sequence(Request(request_id=str(i), prompt_token_ids=list(prompt), params=SamplingParams(**params)))
        s.output_token_ids = list(outputs)
        out.append(s)
    return out


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def sampler(mode: str = "raw_logprobs", seed: int = 0) -> Sampler:
    return Sampler("cpu", seed, [EOS], mode)


def processed_logprobs(x: torch.Tensor, **params) -> torch.Tensor:
    """The full processed distribution of one row, read back through logprobs=V."""
    (s,) = seqs(1, **params, logprobs=V)
    (tok,) = sampler("processed_logprobs")(x[None], [s])
    out = torch.full((V,), float("-inf"))
    for t, lp, _ in tok.logprobs[1:]:
        out[t] = lp
    return out


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    x = logits(16)
    greedy = sampler()(x, seqs(16, temperature=0))
    assert [t.token_id for t in greedy] == x.argmax(-1).tolist()
    topk1 = sampler(seed=5)(x, seqs(16, temperature=1.5, top_k=1))
    assert [t.token_id for t in topk1] == x.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax():
    x = torch.tensor([[0.0, 1.0, 2.0, -1.0] + [-1e9] * (V - 4)]).repeat(20000, 1)
    toks = torch.tensor([t.token_id for t in sampler(seed=3)(x, seqs(20000, temperature=0.7))])
    freq = torch.bincount(toks, minlength=V)[:4].float() / len(toks)
    want = torch.softmax(x[0, :4] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(8, seed=1)
    row = x[5:6]
    (alone,) = sampler(seed=0)(row, seqs(1, temperature=1.0, seed=42))
    batch = seqs(8, temperature=1.0)
    batch[5] = seqs(1, temperature=1.0, seed=42)[0]
    together = sampler(seed=123)(x, batch)
    assert together[5].token_id == alone.token_id
    # and a different output index draws fresh noise: over many positions the tokens vary
    draws = set()
    for k in range(30):
        (s,) = seqs(1, outputs=[4] * k, temperature=5.0, seed=42)
        draws.add(sampler()(row, [s])[0].token_id)
    assert len(draws) > 3


def test_top_k_top_p_min_p_remove_exactly_the_defined_tokens():
    x = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [1e-12] * (V - 5)))
    kept = lambda lp: set(torch.nonzero(lp > float("-inf")).flatten().tolist())  # noqa: E731
    assert kept(processed_logprobs(x, top_k=3)) == {0, 1, 2}
    assert kept(processed_logprobs(x, top_p=0.65)) == {0, 1}  # 0.4 + 0.3 reaches 0.65
    assert kept(processed_logprobs(x, top_p=0.75)) == {0, 1, 2}
    assert kept(processed_logprobs(x, top_p=0.35)) == {0}
    assert kept(processed_logprobs(x, min_p=0.3)) == {0, 1, 2}  # p >= 0.3 * 0.4 = 0.12
    assert kept(processed_logprobs(x, top_k=4, top_p=0.8)) == {0, 1, 2}
    lp = processed_logprobs(x, top_k=2)
    assert lp[0].exp().item() == pytest.approx(0.4 / 0.7, rel=1e-5)  # renormalized over the kept
    toks = {t.token_id for t in sampler(seed=9)(x.repeat(2000, 1), seqs(2000, temperature=1.0, top_p=0.65))}
    assert toks == {0, 1}


def test_repetition_presence_frequency_penalties():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4))
    # repetition: seen tokens (prompt or output) - positive logits divided, negative multiplied
    lp = processed_logprobs(x, prompt=(0,), outputs=(1,), repetition_penalty=2.0)
    want = x.clone()
    want[0], want[1] = 1.0, -4.0
    assert torch.allclose(lp, torch.log_softmax(want, -1), atol=1e-5)
    # frequency and presence: output tokens only, logit -= f * count + p * (count > 0)
    lp = processed_logprobs(x, prompt=(3,), outputs=(2, 2, 0), frequency_penalty=0.5, presence_penalty=0.25)
    want = x.clone()
    want[2] -= 0.5 * 2 + 0.25
    want[0] -= 0.5 * 1 + 0.25
    assert torch.allclose(lp, torch.log_softmax(want, -1), atol=1e-5)


def test_a_tiny_repetition_penalty_keeps_masked_tokens_masked():
    """repetition_penalty 5e-324 (0 in float32): a seen token banned before the penalty (here by
    min_tokens' EOS ban; a grammar's mask alike) stays -inf, not -inf * 0 = NaN, and no logit
    becomes +inf: every draw is a token the row allows."""
    x = torch.tensor([2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4))
    lp = processed_logprobs(x, prompt=(0, EOS, 3), repetition_penalty=5e-324, min_tokens=1)
    assert not lp.isnan().any() and lp[EOS] == float("-inf")
    assert lp[0] == lp.max()  # 2.0 / 5e-324 overflowed to the largest finite logit
    toks = {t.token_id for t in sampler(seed=5)(x.repeat(200, 1), seqs(200, prompt=(0, EOS, 3), temperature=1.0,
            repetition_penalty=5e-324, min_tokens=1))}  # fmt: skip
    assert EOS not in toks


def test_logit_bias_is_added_before_everything_else():
    """OpenAI's logit_bias: added to the raw logits (greedy rows too), before the penalties;
    -100 in effect bans a token, +100 forces it; the raw logprobs stay the model's."""
    x = logits(4, seed=3)
    best = x.argmax(-1)
    greedy = seqs(4, temperature=0, logit_bias={int(best[0]): -100.0, 5: 100.0}, logprobs=1)
    toks = sampler()(x, greedy)
    assert [t.token_id for t in toks] == [5] * 4
    assert toks[0].logprobs[0][1] == pytest.approx(torch.log_softmax(x[0], -1)[5].item(), abs=1e-6)
    banned = sampler()(x[:1], seqs(1, temperature=0, logit_bias={int(best[0]): -100.0}))[0].token_id
    assert banned == int(x[0].clone().index_fill_(0, best[:1], float("-inf")).argmax())
    drawn = sampler(seed=9)(x.repeat(50, 1), seqs(200, temperature=1.0, logit_bias={7: 100.0}))
    assert {t.token_id for t in drawn} == {7}  # a random row sees the bias too
    z = torch.tensor([2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4))
    lp = processed_logprobs(z, outputs=(2,), presence_penalty=0.5, logit_bias={2: 1.5, 3: -0.25})
    want = z.clone()
    want[2] += 1.5 - 0.5
    want[3] -= 0.25
    assert torch.allclose(lp, torch.log_softmax(want, -1), atol=1e-5)


def test_min_tokens_masks_eos_and_stop_token_ids():
    x = torch.zeros(1, V)
    x[0, EOS], x[0, 7], x[0, 4] = 10.0, 9.0, 8.0
    (s,) = seqs(1, temperature=0, min_tokens=2, stop_token_ids=[7], max_tokens=4)
    assert sampler()(x, [s])[0].token_id == 4
    s.output_token_ids = [4, 4]
    assert sampler()(x, [s])[0].token_id == EOS
    (s,) = seqs(1, temperature=0, min_tokens=2, ignore_eos=True, max_tokens=4)
    assert sampler()(x, [s])[0].token_id == EOS  # ignore_eos: EOS is an ordinary token


def test_logprobs_raw_ranks_and_ordering():
    x = logits(3, seed=4)
    rows = seqs(3, temperature=1.0, logprobs=5)
    out = sampler(seed=1)(x, rows)
    full = torch.log_softmax(x, -1)
    for i, tok in enumerate(out):
        (t, lp, rank), *top = tok.logprobs
        assert t == tok.token_id and lp == pytest.approx(full[i, t].item(), abs=1e-6)
        assert rank == int((full[i] > full[i, t]).sum()) + 1
        assert [r for _, _, r in top] == [1, 2, 3, 4, 5]
        vals = [v for _, v, _ in top]
        assert vals == sorted(vals, reverse=True)
        assert [t for t, _, _ in top] == full[i].topk(5).indices.tolist()
    # all V alternatives: probabilities sum to one
    (tok,) = sampler()(x[:1], seqs(1, temperature=1.0, logprobs=V))
    assert math.fsum(math.exp(v) for _, v, _ in tok.logprobs[1:]) == pytest.approx(1.0, abs=1e-5)
    assert sampler()(x[:1], seqs(1))[0].logprobs is None


def test_processed_logprobs_see_temperature():
    x = logits(1, seed=6)
    (tok,) = sampler("processed_logprobs")(x, seqs(1, temperature=0.5, logprobs=0))
    assert tok.logprobs[0][1] == pytest.approx(torch.log_softmax(x[0] / 0.5, -1)[tok.token_id].item(), abs=1e-5)
    assert len(tok.logprobs) == 1  # logprobs=0: the sampled token only


def test_sampling_params_validation_and_round_trip():
    for bad in [
        dict(n=0),
        dict(n=2, best_of=1),
        dict(best_of=129),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(max_tokens=0),
        dict(min_tokens=5, max_tokens=3),
        dict(repetition_penalty=0),
        dict(presence_penalty=3),
        dict(stop=[""]),
        dict(logprobs=-1),
        dict(logit_bias={3: 100.5}),
        dict(bogus=1),
    ]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=2, best_of=5).num_seqs == 5 and SamplingParams(n=3).num_seqs == 3
    p = SamplingParams(temperature=0.3, stop="x", seed=7, logprobs=2, stop_token_ids=[5], logit_bias={4: -1.0})
    assert p.stop == ["x"]
    assert SamplingParams.from_dict(p.to_dict()) == p
