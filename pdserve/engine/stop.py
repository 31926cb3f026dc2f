"""Stop conditions, checked after each new output token (vLLM's order and semantics). No torch.

- Until `min_tokens` outputs exist only the length limits apply.
- EOS (unless ignore_eos) and `stop_token_ids`: finish "stop"; the token stays in token_ids but its
  text is left out unless include_stop_str_in_output.
- Stop strings, searched in the detokenized text: finish "stop"; the text is cut before the stop
  string (after it with include_stop_str_in_output). As vLLM, a stop string must end in the new
  token's text: each token searches only its text and the len(stop) - 1 characters before it, so
  the work per token does not grow with the output (a match that ended in text added before
  min_tokens is never found). Streams hold back the last len(longest stop string) - 1 characters
  so a client never sees text that a stop string removes: what a request shows only grows.
- max_tokens, then max_model_len: finish "length".
"""

from __future__ import annotations

from pdserve.engine.sequence import Sequence, SequenceStatus


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: set[int]) -> bool:
    if seq.num_output_tokens < seq.params.min_tokens:
        return False
    return token_id in seq.params.stop_token_ids or (not seq.params.ignore_eos and token_id in eos_token_ids)


def append_text(seq: Sequence, delta: str, stop_token: bool) -> SequenceStatus | None:
    """Add the new token's text to the output text; returns FINISHED_STOPPED if a stop string ends it."""
    if stop_token and not seq.params.include_stop_str_in_output:
        return None
    text = seq.output_text
    old_len = len(text)
    text.append(delta)
    if not seq.params.stop or not delta or seq.num_output_tokens < seq.params.min_tokens:
        return None
    start = max(0, old_len - max(len(s) for s in seq.params.stop) + 1)
    tail = text.slice(start)  # the new text and the characters before it a match may begin in
    best: tuple[int, str] | None = None
    for stop in seq.params.stop:
        i = tail.find(stop, max(0, old_len - len(stop) + 1 - start))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    text.truncate(start + i + (len(stop) if seq.params.include_stop_str_in_output else 0))
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
    if seq.num_known_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def visible_len(seq: Sequence) -> int:
    """How much of the output text a (streaming) client may see now. A prefill handing off to
    decode is not done: a stop string completed there may still cut what is held back here."""
    n = len(seq.output_text)
    done = seq.finished and seq.status is not SequenceStatus.FINISHED_REMOTE_DECODE
    if done or not seq.params.stop or seq.params.include_stop_str_in_output:
        return n
    return max(0, n - (max(len(s) for s in seq.params.stop) - 1))


def visible_text(seq: Sequence) -> str:
    """The text a (streaming) client may see now (all of it: O(text))."""
    return seq.output_text.slice(0, visible_len(seq))
