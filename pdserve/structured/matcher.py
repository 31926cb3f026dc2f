"""One request's grammar state, advanced by each of its output tokens. No torch.

Its state is a function of the request's output tokens: the engine advances it wherever a token is
appended (sampled here, or the first token a prefill worker handed off), and nothing else ever
changes those tokens (a preempted or recomputed request keeps its outputs), so the state always
matches them. With start_after_token_id the grammar waits (the text is free) until that token
has been generated, and applies to what follows it.

Speculative decoding: drafts are cut at the first token the grammar would refuse (`num_allowed`,
which leaves the state as it was), and each verify position's mask comes from a copy advanced by
the drafts before it (`ahead`); the request's own matcher advances only by the tokens emitted.
"""

from __future__ import annotations

import llguidance as llg

from pdserve.sampling_params import StructuredOutputsParams
from pdserve.structured.compiler import CompiledGrammar


class RequestMatcher:
    def __init__(self, compiled: CompiledGrammar, params: StructuredOutputsParams) -> None:
        self.matcher: llg.LLMatcher = compiled.matcher()
        self.start_after = params.start_after_token_id
        self.active = self.start_after is None  # constraining the next token

    @property
    def terminated(self) -> bool:
        """The grammar is complete and takes nothing more: only EOS is allowed."""
        return self.active and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the grammar rejected a token"

    def advance(self, token_id: int) -> bool:
        """Take an output token; False when the grammar does not allow it (the matcher is then in
        its error state: `error` says why)."""
        if not self.active:
            self.active = token_id == self.start_after
            return True
        if self.matcher.is_stopped():  # only EOS could be sampled; ignore_eos goes on with it
            return not self.matcher.is_error()
        return self.matcher.consume_token(token_id)

    def num_allowed(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from its state now (which stays as it
        was): 0 once it is complete, where only EOS (never a draft worth verifying) is left."""
        n, active = 0, self.active
        while n < len(tokens) and not active:  # free text until start_after
            active = tokens[n] == self.start_after
            n += 1
        if n == len(tokens) or (self.active and self.matcher.is_stopped()):
            return n
        return n + self.matcher.validate_tokens(tokens[n:])

    def ahead(self, tokens: list[int]) -> RequestMatcher:
        """A copy advanced by `tokens` (ones num_allowed took): a verify position's state."""
        copy = object.__new__(RequestMatcher)
        copy.matcher, copy.start_after, copy.active = self.matcher.deep_copy(), self.start_after, self.active
        for t in tokens:
            copy.advance(t)
        return copy
