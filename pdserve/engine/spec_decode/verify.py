"""The runner's side of a verify step: logits for every position of a chunk with drafts, and the
tokens each sequence emits.

A sequence that verifies k drafts was scheduled as one chunk [last token, d_1 .. d_k]: the hidden
rows of all k + 1 give logits (row j scores the token after d_j, d_0 the last token). Each position's
logits are processed as a plain step would process them there (`Ahead`: penalties and min_tokens
count the drafts before it, a grammar's mask is its state after them). Sequences without drafts in
the same step are sampled exactly as a plain step samples them (grammar, seeds, logprobs), so
mixing them with verifying ones changes none of their tokens.
A verifying sequence's logprobs come from each emitted token's own position.

Legend: N sequences that sample, R logits rows (N + all drafts), K most drafts, V vocabulary.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampler import SampledToken, Sampler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.rejection import accept_drafts


def draft_counts(sched: SchedulerOutput) -> list[int] | None:
    """Drafts each sampling sequence verifies, in sampling order; None when none does."""
    counts = [s.num_spec for s in sched.scheduled if s.samples]
    return counts if any(counts) else None


def logits_rows(last_rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The hidden rows that give logits: for each sequence its last row and the `count` before it, [R]."""
    c = torch.tensor(counts, dtype=torch.int64, device=last_rows.device)
    first = torch.repeat_interleave(last_rows - c, c + 1)
    offsets = torch.arange(len(first), device=last_rows.device) - torch.repeat_interleave(
        torch.cumsum(c + 1, 0) - c - 1, c + 1
    )
    return first + offsets


def sample(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], counts: list[int], while_busy=None
) -> list[SampledToken]:
    """logits [R, V] (logits_rows' order) -> one SampledToken per sequence, its `more` the tokens
    after the first that the step emitted too (each with its logprobs where asked). while_busy:
    called once first (the engine's KV loads; ModelRunner.run)."""
    if while_busy is not None:
        while_busy()
    c = torch.tensor(counts, dtype=torch.int64)
    first_row = (torch.cumsum(c + 1, 0) - c - 1).tolist()
    if not sampler.changes_logits(seqs):  # greedy rows on their raw logits: one argmax, one read
        return _greedy(sampler, logits, seqs, first_row, counts)
    plain = [i for i, n in enumerate(counts) if n == 0]
    spec = [i for i, n in enumerate(counts) if n > 0]
    out: list[SampledToken | None] = [None] * len(seqs)
    if plain:
        rows = logits[[first_row[i] for i in plain]]
        group = [seqs[i] for i in plain]
        for i, tok in zip(plain, sampler(rows, group)):
            out[i] = tok
    if spec:
        for i, tok in zip(
            spec,
            _verify(sampler, logits, [seqs[i] for i in spec], [first_row[i] for i in spec], [counts[i] for i in spec]),
        ):
            out[i] = tok
    return out


class Ahead:
    """A sequence as the sampler sees it at a verify chunk's position j: its first j drafts taken
    as output, so penalties and min_tokens at each position are those a plain step there would
    apply (the row matters only if those drafts are accepted), and its structured-outputs grammar
    is the request's advanced by those drafts (a copy: the request's own advances by emitted tokens)."""

    def __init__(self, seq: Sequence, j: int) -> None:
        self.params = seq.params
        self.grammar = seq.grammar.ahead(seq.spec_token_ids[:j]) if seq.grammar is not None and j else seq.grammar
        self.output_token_ids = seq.output_token_ids + seq.spec_token_ids[:j]
        self._prompt = seq.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def next_output_index(self) -> int:  # verify steps run serially: no token is in flight
        return len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self._prompt + self.output_token_ids


def _verify(
    sampler: Sampler, logits, seqs: list[Sequence], first_rows: list[int], counts: list[int]
) -> list[SampledToken]:
    N, K, V = len(seqs), max(counts), logits.shape[1]
    dev = logits.device
    rows = torch.cat([torch.arange(r, r + n + 1) for r, n in zip(first_rows, counts)]).to(dev)
    x = sampler.process(logits[rows], [Ahead(s, j) for s, n in zip(seqs, counts) for j in range(n + 1)])  # [R', V]
    padded = x.new_zeros(N, K + 1, V)
    pos = torch.cat([torch.arange(n + 1) for n in counts]).to(dev)
    seq = torch.repeat_interleave(torch.arange(N), torch.tensor(counts) + 1).to(dev)
    padded[seq, pos] = x
    drafts = torch.tensor(
        [s.spec_token_ids[:n] + [0] * (K - n) for s, n in zip(seqs, counts)], dtype=torch.int64, device=dev
    )
    greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
    seeds = [
        (s.params.seed, s.num_output_tokens) if s.params.seed is not None and not s.params.greedy else None
        for s in seqs
    ]
    tokens, accepted = accept_drafts(
        padded, drafts, torch.tensor(counts, device=dev), greedy, sampler.generator, seeds=seeds
    )
    rows_and_counts = torch.cat([tokens, accepted[:, None]], dim=1).tolist()  # one read back: [N, K+2]
    emitted = [row[: row[-1] + 1] for row in rows_and_counts]
    out = [SampledToken(e[0], more=[SampledToken(t) for t in e[1:]]) for e in emitted]
    _logprobs(sampler, logits[rows] if sampler.logprobs_mode == "raw_logprobs" else x, seqs, counts, emitted, out)
    return out


def _greedy(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], first_rows: list[int], counts: list[int]
) -> list[SampledToken]:
    """`sample` where every row is greedy and `process` would change none: each sequence emits
    its drafts up to the first that differs from the argmax at its position, then that argmax
    (`accept_drafts`' greedy rule, drafts clamped into the vocabulary as there), decided on the
    host from one read of the argmax of every row."""
    V = logits.shape[1]
    target = logits.argmax(dim=-1).tolist()  # [R]
    emitted = []
    for s, r, n in zip(seqs, first_rows, counts):
        a = 0
        while a < n and min(max(s.spec_token_ids[a], 0), V - 1) == target[r + a]:
            a += 1
        emitted.append(target[r : r + a + 1])
    out = [SampledToken(e[0], more=[SampledToken(t) for t in e[1:]]) for e in emitted]
    _logprobs(sampler, logits, seqs, counts, emitted, out)  # raw = processed logits here
    return out


def _logprobs(sampler, source, seqs, counts, emitted, out) -> None:
    """Logprobs of every emitted token where asked, each from its own position's row of `source`
    ([R', V]: raw or processed logits, chunk after chunk), as a plain step computes them."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not want:
        return
    starts = [sum(n + 1 for n in counts[:i]) for i in range(len(counts))]
    where = [(i, j) for i in want for j in range(len(emitted[i]))]
    tokens = torch.tensor([emitted[i][j] for i, j in where], device=source.device)
    rows = torch.tensor([starts[i] + j for i, j in where], device=source.device)
    for (i, j), tok in zip(where, sampler.read(tokens, source[rows], [seqs[i] for i, _ in where])):
        (out[i] if j == 0 else out[i].more[j - 1]).logprobs = tok.logprobs
