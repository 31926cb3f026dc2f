"""A step's output for one request: what its output_kind asks of its sequences' state at the
step's end (delta: the tokens, text and logprobs since its last output, O(new); cumulative: all
so far; final_only: all, once it finishes). A request with several sequences (n > 1, forks.py)
gives one output with a CompletionOutput per sequence that advanced (delta), per sequence
(cumulative), or per returned sequence once all are done (final_only; best_of > n: always)."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.sequence import SeqGroup, Sequence, SequenceStatus
from pdserve.engine.stop import visible_len
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import RequestOutputKind


def step_outputs(touched: Iterable[Sequence]) -> list[RequestOutput | None]:
    """One output per request among the step's sequences (None: nothing to give yet)."""
    groups: dict[str, tuple[SeqGroup, list[Sequence]]] = {}
    out: list[RequestOutput | None] = []
    for seq in touched:
        if seq.group is None:
            out.append(request_output(seq))
        else:
            groups.setdefault(seq.group.request_id, (seq.group, []))[1].append(seq)
    out += [group_output(group, seqs) for group, seqs in groups.values()]
    return out


def request_output(seq: Sequence) -> RequestOutput | None:
    """seq's output at a step's end, as its request's output_kind asks (None: final_only, not finished)."""
    kind = seq.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not seq.finished:
        return None
    return _output(seq, [completion(seq, kind)], seq.finished)


def group_output(group: SeqGroup, advanced: list[Sequence]) -> RequestOutput | None:
    """The output of a request with several sequences, of which `advanced` moved this step."""
    parent = group.seqs[0]
    kind = parent.params.output_kind
    if group.ranked or kind is RequestOutputKind.FINAL_ONLY:
        if not group.finished:
            return None
        completions = [completion(s, RequestOutputKind.FINAL_ONLY, index=i) for i, s in enumerate(group.best())]
    else:  # cumulative: every sequence's whole output; delta: what the advanced ones added
        seqs = group.seqs if kind is RequestOutputKind.CUMULATIVE else sorted(advanced, key=lambda s: s.index)
        completions = [completion(s, kind) for s in seqs]
    if group.hide_logprobs:
        for c in completions:
            c.logprobs = c.cumulative_logprob = None
    out = _output(parent, completions, group.finished)
    out.error = next((s.error for s in group.seqs if s.error), None)
    return out


def completion(seq: Sequence, kind: RequestOutputKind, index: int | None = None) -> CompletionOutput:
    """seq's part of an output (delta: since its last output; else all of it)."""
    sent = seq.num_sent_tokens if kind is RequestOutputKind.DELTA else 0
    shown = seq.num_sent_chars if kind is RequestOutputKind.DELTA else 0
    visible = max(visible_len(seq), shown)
    seq.num_sent_tokens, seq.num_sent_chars = seq.num_output_tokens, visible
    return CompletionOutput.model_construct(
        index=seq.index if index is None else index,
        text=seq.output_text.slice(shown, visible),
        token_ids=seq.output_token_ids[sent:],
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=seq.logprobs[sent:] if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def _output(seq: Sequence, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    return RequestOutput.model_construct(
        request_id=seq.request.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=completions,
        finished=finished,
        kv_handle=seq.kv_handle if seq.status is SequenceStatus.FINISHED_REMOTE_DECODE else None,
        kv_handoff_sent=seq.handoff_sent,
        prefill_text_offset=seq.first_token.text_offset if seq.first_token is not None else None,
        error=seq.error,
        transfer_error=seq.transfer_error,
        num_cached_tokens=seq.num_cached_tokens,
    )
