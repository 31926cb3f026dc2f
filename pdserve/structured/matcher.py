"""One request's grammar state, advanced by each of its output tokens. No torch.

Its state is a function of the request's output tokens: the engine advances it wherever a token is
appended (sampled here, or the first token a prefill worker handed off), and nothing else ever
changes those tokens (a preempted or recomputed request keeps its outputs), so the state always
matches them. With start_after_token_id the grammar waits (the text is free) until that token
has been generated, and applies to what follows it.
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
