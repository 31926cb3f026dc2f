"""A step's output for one request: what its output_kind asks of the sequence's state at the
step's end (delta: the tokens, text and logprobs since its last output, O(new); cumulative: all
so far; final_only: all, once it finishes)."""

from __future__ import annotations

from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.stop import visible_len
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import RequestOutputKind


def request_output(seq: Sequence) -> RequestOutput | None:
    """seq's output at a step's end, as its request's output_kind asks (None: final_only, not finished)."""
    kind = seq.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not seq.finished:
        return None
    sent = seq.num_sent_tokens if kind is RequestOutputKind.DELTA else 0
    shown = seq.num_sent_chars if kind is RequestOutputKind.DELTA else 0
    visible = max(visible_len(seq), shown)
    seq.num_sent_tokens, seq.num_sent_chars = seq.num_output_tokens, visible
    completion = CompletionOutput.model_construct(
        index=0,
        text=seq.output_text.slice(shown, visible),
        token_ids=seq.output_token_ids[sent:],
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=seq.logprobs[sent:] if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    return RequestOutput.model_construct(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.finished,
        kv_handle=seq.kv_handle if seq.status is SequenceStatus.FINISHED_REMOTE_DECODE else None,
        kv_handoff_sent=seq.handoff_sent,
        prefill_text_offset=seq.first_token.text_offset if seq.first_token is not None else None,
        error=seq.error,
        transfer_error=seq.transfer_error,
        num_cached_tokens=seq.num_cached_tokens,
    )
