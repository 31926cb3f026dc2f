"""N-gram (prompt-lookup) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. No weights, no torch: useful where outputs repeat their input (code edits, retrieval)."""

from __future__ import annotations

from pdserve.engine.sequence import Sequence


class NgramProposer:
    drafts_from_tokens = True  # needs nothing but the tokens: drafts before a sequence's first step here

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow seq's tokens ([] when no n-gram recurs)."""
        return lookup(seq.token_ids(), self.lookup_min, self.lookup_max, limit)


def lookup(tokens: list[int], lookup_min: int, lookup_max: int, limit: int) -> list[int]:
    L = len(tokens)
    last = tokens[-1] if tokens else None
    # candidate ends: earlier positions holding the last token (the match's last position)
    ends = [j for j in range(L - 2, -1, -1) if tokens[j] == last]
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        suffix = tokens[L - n :]
        for j in ends:  # latest first
            if j + 1 >= n and tokens[j + 1 - n : j + 1] == suffix:
                return tokens[j + 1 : j + 1 + limit]
    return []
