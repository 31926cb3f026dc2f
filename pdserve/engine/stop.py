"""Stop conditions, checked after each new output token (vLLM's order and semantics). No torch.

- Until `min_tokens` outputs exist only the length limits apply.
- EOS (unless ignore_eos) and `stop_token_ids`: finish "stop"; the token stays in token_ids but its
  text is left out unless include_stop_str_in_output.
- Stop strings, searched in the detokenized text: finish "stop"; the text is cut before the stop
  string (after it with include_stop_str_in_output). Streams hold back the last
  len(longest stop string) - 1 characters so a client never sees text that a stop string removes.
- max_tokens, then max_model_len: finish "length".
"""

from __future__ import annotations

from pdserve.engine.sequence import Sequence, SequenceStatus


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: set[int]) -> bool:
    if seq.num_output_tokens < seq.params.min_tokens:
        return False
    return token_id in seq.params.stop_token_ids or (not seq.params.ignore_eos and token_id in eos_token_ids)


def append_text(seq: Sequence, delta: str, stop_token: bool) -> SequenceStatus | None:
    """Add the new token's text to seq.text; returns FINISHED_STOPPED if a stop string ends it."""
    if stop_token and not seq.params.include_stop_str_in_output:
        return None
    old_len = len(seq.text)
    seq.text += delta
    if not seq.params.stop or not delta or seq.num_output_tokens < seq.params.min_tokens:
        return None
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, old_len - longest + 1)  # a match may begin in text we already had
    best: tuple[int, str] | None = None
    for stop in seq.params.stop:
        i = seq.text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    seq.text = seq.text[: i + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:i]
    seq.stop_reason = stop
    return SequenceStatus.FINISHED_STOPPED


def check_stop(
    seq: Sequence, token_id: int, delta: str, eos_token_ids: set[int], max_model_len: int
) -> SequenceStatus | None:
    """Call after seq.append_token(token_id); delta is that token's new text ("" without a
    detokenizer). Returns the finished status, or None to keep going."""
    stop_token = is_stop_token(seq, token_id, eos_token_ids)
    by_string = append_text(seq, delta, stop_token)
    if stop_token:
        seq.stop_reason = token_id if token_id in seq.params.stop_token_ids else None
        return SequenceStatus.FINISHED_STOPPED
    if by_string is not None:
        return by_string
    if seq.params.max_tokens is not None and seq.num_output_tokens >= seq.params.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    if seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def visible_text(seq: Sequence) -> str:
    """The text a (streaming) client may see now. A prefill handing off to decode is not done: a
    stop string completed there may still cut what is held back here."""
    done = seq.finished and seq.status is not SequenceStatus.FINISHED_REMOTE_DECODE
    if done or not seq.params.stop or seq.params.include_stop_str_in_output:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[: max(0, len(seq.text) - hold)] if hold else seq.text
