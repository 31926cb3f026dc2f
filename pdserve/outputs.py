"""What the engine returns per request, in vLLM's shapes. Pydantic: workers send them as JSON.

What an output carries is the request's `SamplingParams.output_kind`: everything so far
(cumulative, vLLM's default), only what is new since the request's last output (delta: a stream;
`RequestOutput.add` folds deltas back into the cumulative output), or one output at the end with
everything (final_only: `LLM.generate`). The other fields are the request's state at that output
in every kind (cumulative_logprob is the running sum).

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

    def add(self, later: RequestOutput) -> None:
        """Fold the request's next delta output into this one (vLLM's `add` with aggregate=True):
        its new tokens, text and logprobs are appended; of the rest, what `later` sets wins.
        Costs what `later` holds and a copy of this one's text (a stream's: what is unread).
        Several sequences (n > 1): each of later's outputs folds into the one of its index."""
        for new in later.outputs:
            mine = next((c for c in self.outputs if c.index == new.index), None)
            if mine is None:
                self.outputs.append(new.model_copy(deep=True))
                continue
            mine.token_ids.extend(new.token_ids)
            mine.text += new.text
            if new.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(new.logprobs)
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
            if new.cumulative_logprob is not None:
                mine.cumulative_logprob = new.cumulative_logprob
        self.finished = self.finished or later.finished
        self.kv_handoff_sent = self.kv_handoff_sent or later.kv_handoff_sent
        for name in ("kv_handle", "prefill_text_offset", "error", "transfer_error", "num_cached_tokens"):
            if getattr(later, name) is not None:
                setattr(self, name, getattr(later, name))
