"""Next-token sampling for one batch of sequences, with vLLM's semantics.

Order, per row: the structured-outputs grammar's token mask (pdserve/structured/bitmask.py; a
complete answer allows only EOS, and min_tokens does not hold it back) -> min_tokens (EOS and
stop_token_ids masked until min_tokens outputs exist) -> repetition penalty (prompt + output tokens: positive logits divided by it, negative multiplied) ->
frequency and presence penalties (output tokens: logit -= frequency * count + presence * (count > 0))
-> temperature -> min_p -> top_k -> top_p -> sample. Greedy rows (temperature 0) take the argmax
of the penalized logits; temperature and filters do not touch them.

Random rows sample by the exponential race: argmax(probs / q) with q ~ Exp(1), which draws from
probs. A seeded request draws its q from a generator seeded by (seed, output index), so its tokens
depend neither on the rest of the batch nor on where the request ran before (prefill vs decode
worker). Unseeded rows share the engine's generator.

Logprobs: `raw_logprobs` (default, as vLLM V1) = log_softmax of the model's logits before any
processing; `processed_logprobs` = log_softmax of the logits the token was drawn from (after
penalties, temperature and filtering; filtered tokens get -inf).

Legend: N rows (sequences that sample this step), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


F32_MAX = torch.finfo(torch.float32).max


def row_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): distinct, well-mixed generator seeds per output position."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampledToken:
    token_id: int
    # (token id, logprob, 1-based rank): the sampled token first, then the top-N; None if not asked
    logprobs: list[tuple[int, float, int]] | None = None
    # speculative decoding: the tokens after token_id this step also emitted (accepted drafts and
    # the target's token after them; spec_decode/verify.py)
    more: list[SampledToken] = field(default_factory=list)


class Sampler:
    def __init__(
        self,
        device: torch.device | str,
        seed: int,
        eos_token_ids: list[int],
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)
        self.logprobs_mode = logprobs_mode
        self.masks = None  # structured outputs' TokenMasks, made at the first constrained step

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        return self.read(*self.draw(logits, seqs), seqs)

    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled token ids [N] and the logits their logprobs come from, still on the device
        (queued, not waited for: `read` is where the host waits for the step)."""
        x = self.process(logits, seqs) if self.changes_logits(seqs) else logits.float()
        if all(s.params.greedy for s in seqs):
            tokens = x.argmax(dim=-1)  # [N]
        else:
            greedy = torch.tensor([s.params.greedy for s in seqs], device=x.device)
            tokens = torch.where(greedy, x.argmax(dim=-1), self._random(x, seqs))  # [N]
        lp_source = logits if self.logprobs_mode == "raw_logprobs" else x
        return tokens, lp_source

    def changes_logits(self, seqs: list[Sequence]) -> bool:
        """Whether `process` may change a row: a random row, a grammar, min_tokens still to reach
        or a penalty. Else a row's token is the argmax of its raw logits (no [N, V] copy: 66 MB at
        N = 128 for V4's vocabulary)."""
        for s in seqs:
            p = s.params
            if not p.greedy or s.grammar is not None or s.next_output_index < p.min_tokens or p.logit_bias:
                return True
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                return True
        return False

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits a row's token is drawn from [N, V] float32 (a copy): masks and penalties,
        then, on random rows only, temperature and the filters (-inf where filtered). Greedy rows
        take the argmax of theirs; speculative decoding's rejection sampling uses the same rows."""
        # logits: [N, V]
        x = logits.float().clone()
        self._logit_bias(x, seqs)
        self._grammar_mask(x, seqs)
        self._min_tokens(x, seqs)
        self._penalties(x, seqs)
        if all(s.params.greedy for s in seqs):  # greedy rows are never filtered or scaled
            return x
        temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs], device=x.device)
        x = x / temps[:, None]
        x = self._min_p(x, seqs)
        return self._top_k_top_p(x, seqs)

    def read(self, tokens: torch.Tensor, lp_source: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """draw's tokens (and logprobs where asked) on the host."""
        return self.stage(tokens, lp_source, seqs).read()

    # -- logits processing (in place on x: [N, V]) --
    def _grammar_mask(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        """Structured outputs: tokens the row's grammar does not allow -> -inf (nothing when no row
        has a grammar: unconstrained batches take the path they always took)."""
        if all(s.grammar is None for s in seqs):
            return
        if self.masks is None:
            from pdserve.structured.bitmask import TokenMasks

            self.masks = TokenMasks(x.shape[1], self.device)
        mask = self.masks.fill([s.grammar for s in seqs])
        if mask is not None:
            self.masks.apply(x, mask)

    def _logit_bias(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            bias = s.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=x.device)
                x[i, ids] += torch.tensor(list(bias.values()), dtype=x.dtype, device=x.device)

    def _min_tokens(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            if s.grammar is not None and s.grammar.terminated:  # a complete answer may end: EOS is all it allows
                continue
            if s.next_output_index < s.params.min_tokens:
                stop_ids = list(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    stop_ids += self.eos_token_ids
                if stop_ids:
                    x[i, stop_ids] = float("-inf")

    def _penalties(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        V = x.shape[1]
        for i, s in enumerate(seqs):
            p = s.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(s.token_ids(), dtype=torch.long, device=x.device).unique()
                row = x[i, seen]
                # float32: a penalty below its range is 0 (5e-324 is, as a request may send): what a
                # mask or a ban made -inf stays -inf (not -inf * 0 = NaN, which could be drawn), and
                # a division overflowing to +inf is the largest finite logit instead
                scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                x[i, seen] = torch.where(row == float("-inf"), row, scaled.nan_to_num(posinf=F32_MAX))
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and s.output_token_ids:
                out = torch.tensor(s.output_token_ids, dtype=torch.long, device=x.device)
                counts = torch.bincount(out, minlength=V)[:V].to(x.dtype)  # [V]
                x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)

    def _min_p(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if not any(s.params.min_p > 0 and not s.params.greedy for s in seqs):
            return x
        min_p = torch.tensor([0.0 if s.params.greedy else s.params.min_p for s in seqs], device=x.device)  # [N]
        probs = x.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        return x.masked_fill(~keep, float("-inf"))

    def _top_k_top_p(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # greedy rows are left unfiltered, so their processed logprobs do not depend on the batch
        use_k = any(s.params.top_k_active and not s.params.greedy for s in seqs)
        use_p = any(s.params.top_p < 1.0 and not s.params.greedy for s in seqs)
        if not (use_k or use_p):
            return x
        V = x.shape[1]
        sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if use_k:
            ks = [min(s.params.top_k, V) if s.params.top_k_active and not s.params.greedy else V for s in seqs]
            ks = torch.tensor(ks, device=x.device)
            remove |= torch.arange(V, device=x.device)[None, :] >= ks[:, None]
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        if use_p:
            # keep the smallest prefix whose mass reaches top_p; rows with top_p = 1 keep all
            top_p = [s.params.top_p if s.params.top_p < 1.0 and not s.params.greedy else 2.0 for s in seqs]
            top_p = torch.tensor(top_p, device=x.device)
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            remove |= before >= top_p[:, None]  # the first token always stays (before = 0)
        return x.scatter(1, order, sorted_x.masked_fill(remove, float("-inf")))

    # -- drawing --
    def _random(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = x.softmax(dim=-1)  # [N, V]
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.greedy:
                g = torch.Generator(device=x.device).manual_seed(row_seed(s.params.seed, s.next_output_index))
                q[i] = torch.empty_like(probs[i]).exponential_(generator=g)
        # q = 0 would turn a filtered token's 0 / 0 into NaN, which argmax would pick
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    def stage(self, tokens: torch.Tensor, lp_source: torch.Tensor, seqs: list[Sequence]) -> StagedTokens:
        """Queue the logprobs' device work behind draw's and start the copies to the host, without
        waiting: the overlapped loop reads them (`StagedTokens.read`) while the next step runs."""
        parts = {"tokens": tokens}
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        ks = [seqs[i].params.logprobs for i in rows]
        if rows:
            lp = torch.log_softmax(lp_source[rows].float(), dim=-1)  # [R, V]
            chosen_lp = lp.gather(1, tokens[rows][:, None])  # [R, 1]
            parts["chosen_lp"], parts["ranks"] = chosen_lp[:, 0], (lp > chosen_lp).sum(dim=-1) + 1  # [R] each
            if max(ks) > 0:
                top = lp.topk(min(max(ks), lp.shape[1]), dim=-1)
                parts["top_ids"], parts["top_lp"] = top.indices, top.values  # [R, k]
        return StagedTokens(parts, rows, ks)


class StagedTokens:
    """A step's sampled tokens [N] (and the logprob rows asked for) on their way to the host:
    non-blocking copies into pinned memory and an event after them on CUDA, the tensors
    themselves on CPU. `tokens` stays on the device: the next step's inputs (ModelRunner's feed)."""

    def __init__(self, parts: dict[str, torch.Tensor], rows: list[int], ks: list[int]) -> None:
        self.tokens = parts["tokens"]
        self.rows, self.ks = rows, ks  # rows asking for logprobs, and how many top entries each
        self.done: torch.cuda.Event | None = None
        if self.tokens.is_cuda:  # a non-blocking copy to the CPU lands in pinned memory
            parts = {k: v.to("cpu", non_blocking=True) for k, v in parts.items()}
            self.done = torch.cuda.Event()
            self.done.record()
        self.host = parts

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def read(self) -> list[SampledToken]:
        """The tokens (waits for their copy alone, not for work queued after it)."""
        if self.done is not None:
            self.done.synchronize()
        h = self.host
        token_list = h["tokens"].tolist()
        out = [SampledToken(t) for t in token_list]
        if not self.rows:
            return out
        chosen, ranks = h["chosen_lp"].tolist(), h["ranks"].tolist()
        top_ids, top_lp = (h["top_ids"].tolist(), h["top_lp"].tolist()) if "top_ids" in h else ([], [])
        for j, (i, k) in enumerate(zip(self.rows, self.ks)):
            entries = [(token_list[i], chosen[j], int(ranks[j]))]
            if k > 0:
                entries += [(t, v, r + 1) for r, (t, v) in enumerate(zip(top_ids[j][:k], top_lp[j][:k]))]
            out[i].logprobs = entries
        return out
