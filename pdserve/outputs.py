"""What the engine returns per request, in vLLM's shapes. Pydantic: workers send them as JSON.

Outputs are cumulative (each carries all tokens and text so far), as vLLM's LLMEngine returns them.

finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or
max_model_len), "abort", "error" (see `RequestOutput.error`), or None while running. A prefill-role
request (hold_kv) that did not stop on its first token finishes with finish_reason None and a
`kv_handle`: it continues on a decode worker.
"""

from __future__ import annotations

from pydantic import BaseModel

from pdserve.disagg.base import KVHandle, TransferFailure


class Logprob(BaseModel):
    logprob: float
    rank: int  # 1-based rank of this token in the distribution
    decoded_token: str | None = None


# one dict per generated token: the sampled token and its top-N alternatives
SampleLogprobs = list[dict[int, Logprob]]


class LogprobEntry(BaseModel):
    """One token's logprob in wire form (a list keeps the order: the sampled token first)."""

    token_id: int
    logprob: float
    rank: int  # 1-based
    token: str | None = None  # the token's text on its own


# One generated token's logprobs on the wire: the sampled token first, then its top-N by rank.
TokenLogprobs = list[LogprobEntry]


def to_entries(step: dict[int, Logprob]) -> TokenLogprobs:
    return [
        LogprobEntry(token_id=t, logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token) for t, lp in step.items()
    ]


def from_entries(entries: TokenLogprobs) -> dict[int, Logprob]:
    return {e.token_id: Logprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token) for e in entries}


class CompletionOutput(BaseModel):
    index: int = 0
    text: str = ""
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(BaseModel):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    kv_handle: KVHandle | None = None  # prefill role: where this request's KV waits for decode
    kv_handoff_sent: bool = False  # prefill role: the decode engine was sent the hand-off itself
    # decode role: characters of output text the client had from prefill (FirstToken.text_offset)
    prefill_text_offset: int | None = None
    error: str | None = None  # finish_reason "error": what went wrong
    transfer_error: TransferFailure | None = None  # decode role: the KV load that failed, as data
    # prompt tokens whose KV came from the prefix cache at the request's first admission (vLLM's
    # name; None before it is admitted here, 0 on a decode worker that loaded the prompt's KV)
    num_cached_tokens: int | None = None
