"""`speculative_config` as vLLM spells it, validated (unknown methods and fields are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 8
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram window when neither bound is given
# a prefill worker samples one token a request and hands the rest to a decode worker
SPEC_ON_PREFILL = (
    "speculative_config has nothing to do on a prefill worker: give it to the decode (or colocated) workers"
)
# methods pdserve knows the name of but does not run yet: refused with this reason
NOT_YET: dict[str, str] = {}
# MTP's drafts start from the MTP layer's KV and hidden state over the prompt: not yet carried by the hand-off
MTP_UNDER_PD = (
    "speculative method 'mtp' is not yet supported on PD (prefill / decode) workers: it runs on colocated "
    "workers; use method 'ngram' for PD"
)
MTP_UNDER_TP = "speculative method 'mtp' with tensor_parallel_size > 1 is not yet supported"


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
