"""`speculative_config` as vLLM spells it, validated (unknown methods and fields are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 8
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram window when neither bound is given
# a prefill worker samples one token a request and hands the rest to a decode worker; with MTP it
# computes the MTP layer's records of the prompt and the first draft's hidden state (mtp_handoff.py)
SPEC_ON_PREFILL = (
    "speculative_config on a prefill worker takes method 'mtp' only (the MTP layer's KV and hidden state for "
    "the decode worker); other methods draft on the decode (or colocated) workers: give it to those"
)
# methods pdserve knows the name of but does not run yet: refused with this reason
NOT_YET: dict[str, str] = {}
# both sides of a PD pair draft with MTP or neither does: the MTP layer is one more layer of the pool
MTP_PAIR = (
    "speculative method 'mtp' under PD needs it on both the prefill and the decode workers "
    "(the prefill side computes the MTP layer's KV and hidden state the decode side drafts from)"
)


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)  # k: drafts verified per step
    prompt_lookup_min: int | None = Field(None, ge=1)  # ngram: shortest suffix matched
    prompt_lookup_max: int | None = Field(None, ge=1)  # ngram: longest suffix matched

    @model_validator(mode="after")
    def _method(self) -> SpeculativeConfig:
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config: {NOT_YET[self.method]}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = lo or hi, hi or lo
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        self.__dict__.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
        return self
