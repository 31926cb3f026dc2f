"""Which drafts a verify step accepts, and the token it adds after them.

Greedy rows: draft j is accepted while it equals the target's argmax at j; the first mismatch is
replaced by the argmax, and when all drafts are accepted the argmax after the last one is added
(the bonus token). So the tokens are exactly those of plain greedy decoding.

Random rows (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
2023): draft x_j, drawn from the draft distribution q_j, is accepted with probability
min(1, p_j(x_j) / q_j(x_j)), p_j the target's distribution after the sampler's processing
(temperature, min_p, top_k, top_p: `Sampler.process`). At the first rejection the token is drawn
from the residual norm(max(0, p_j - q_j)); when every draft is accepted the bonus token is drawn
from p_k. Each emitted token is then distributed exactly as p given the tokens before it. Drafts
proposed deterministically (n-gram lookup, greedy drafters) have q one-hot at the draft: accepted
with probability p_j(x_j), the residual is p_j without x_j.

Legend: N sequences that verify, K most drafts of any of them, V vocabulary.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampler import row_seed

_UNIFORM_SALT = 0x5EC0DE  # a seeded row's acceptance uniforms: a stream apart from its races


def _seeded(seed: int, index: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(row_seed(seed, index))


def accept_drafts(
    logits: torch.Tensor,  # [N, K+1, V] processed target logits (-inf: filtered); row j scores position j
    drafts: torch.Tensor,  # [N, K] int64 draft tokens (padding past num_drafts is ignored)
    num_drafts: torch.Tensor,  # [N] int64
    greedy: torch.Tensor,  # [N] bool
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,  # [N, K, V] q; None: one-hot at the drafts
    seeds: list[tuple[int, int] | None] | None = None,  # per row: (request seed, its next output index)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, K+1] int64, -1 past each row's end; num_accepted [N] int64). Row n emits its
    first num_accepted[n] drafts and then one token from the target: num_accepted[n] + 1 tokens.
    A seeded row draws from its own generators instead of `generator`: its acceptance uniforms
    from (seed, output index) salted, its last token's exponential race from (seed, that token's
    output index), the stream a plain step at that index draws from (sampler.py)."""
    N, K1, V = logits.shape
    K = K1 - 1
    pos = torch.arange(K, device=logits.device)
    valid = pos[None, :] < num_drafts[:, None]  # [N, K]
    safe = drafts.clamp(0, V - 1)
    target = logits.argmax(dim=-1)  # [N, K+1]
    ok = valid & (safe == target[:, :K])  # greedy acceptance
    all_greedy = bool(greedy.all())
    probs = None if all_greedy else logits.softmax(dim=-1)  # [N, K+1, V]
    if not all_greedy:
        p_draft = probs[:, :K].gather(2, safe[..., None])[..., 0]  # [N, K]
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, safe[..., None])[..., 0]
        u = torch.rand(p_draft.shape, generator=generator, device=logits.device)
        for n, s in enumerate(seeds or []):
            if s is not None:
                u[n] = torch.rand(K, generator=_seeded(s[0] ^ _UNIFORM_SALT, s[1], u.device), device=u.device)
        ok = torch.where(greedy[:, None], ok, valid & (u * q_draft < p_draft))
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [N] drafts before the first rejection
    last = _last_token(probs, target, safe, accepted, num_drafts, greedy, generator, draft_probs, seeds)  # [N]
    idx = torch.arange(K1, device=logits.device)[None, :]
    tokens = torch.cat([safe, torch.zeros_like(safe[:, :1])], dim=1)
    tokens = torch.where(idx < accepted[:, None], tokens, -1)
    tokens.scatter_(1, accepted[:, None], last[:, None])
    return tokens, accepted


def _last_token(probs, target, drafts, accepted, num_drafts, greedy, generator, draft_probs, seeds) -> torch.Tensor:
    """The target's token at each row's first rejected position (or after its last draft): [N]."""
    rows = torch.arange(target.shape[0], device=target.device)
    if bool(greedy.all()):
        return target[rows, accepted]
    p = probs[rows, accepted]  # [N, V] the target at that position
    rejected = accepted < num_drafts  # [N] a draft was rejected there (else: the bonus token)
    at = accepted.clamp(max=max(drafts.shape[1] - 1, 0))
    if draft_probs is None:
        q = torch.zeros_like(p)
        if drafts.shape[1]:
            q.scatter_(1, drafts[rows, at][:, None], 1.0)
    else:
        q = draft_probs[rows, at]
    residual = (p - q).clamp(min=0)
    # p == q leaves no residual, but then the draft is never rejected; guard the 0 / 0 anyway
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    dist = torch.where(rejected[:, None], residual, p)
    e = torch.empty_like(dist).exponential_(generator=generator)
    if seeds and any(s is not None for s in seeds):
        at_index = accepted.tolist()
        for n, s in enumerate(seeds):
            if s is not None:
                e[n] = torch.empty_like(e[n]).exponential_(generator=_seeded(s[0], s[1] + at_index[n], e.device))
    e.clamp_(min=torch.finfo(dist.dtype).tiny)
    drawn = (dist / e).argmax(dim=-1)  # the exponential race draws from dist (unnormalized is fine)
    return torch.where(greedy, target[rows, accepted], drawn)
