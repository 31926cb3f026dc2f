"""Streamed text -> plain text and marker strings (think tags, tool-call markup, special tokens).

A marker may arrive split over several deltas (a special token's text, a DSML tag written as
several tokens), so the scanner holds back a tail that could still grow into a marker. Where two
markers could match at one place the longest wins; where one begins inside another that is not
complete yet, nothing past the outer one's start is decided. So the events do not depend on how
the text was split: only where text pieces break.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

Event = tuple[bool, str]  # (is a marker, its text)


@lru_cache(maxsize=64)
def _compiled(markers: frozenset[str]) -> tuple[re.Pattern | None, frozenset[str], int]:
    """(a pattern finding the earliest, then longest, marker; every proper prefix; the longest's
    length): made once per marker set, as every request of a server uses the same few."""
    ordered = sorted((m for m in markers if m), key=len, reverse=True)
    find = re.compile("|".join(re.escape(m) for m in ordered)) if ordered else None
    prefixes = frozenset(m[:k] for m in ordered for k in range(1, len(m)))
    return find, prefixes, len(ordered[0]) if ordered else 0


class MarkerScanner:
    def __init__(self, markers: Iterable[str]) -> None:
        self._find, self._prefixes, self._longest = _compiled(frozenset(markers))
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self, cut: bool = False) -> list[Event]:
        """Everything held back, as the whole text ends here; cut (the output was cut off): a tail
        that could still have grown into a marker is dropped instead."""
        if not cut:
            return self._drain(final=True)
        out, self._buf = self._drain(final=False), ""
        return out

    def strip(self, text: str) -> str:
        """`text` without any marker in it."""
        return self._find.sub("", text) if self._find is not None else text

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            hit = self._find.search(self._buf) if self._find is not None else None
            hold = len(self._buf) if final else self._partial_start()
            if hit is not None and hit.start() < hold:
                if hit.start():
                    out.append((False, self._buf[: hit.start()]))
                out.append((True, hit.group()))
                self._buf = self._buf[hit.end() :]
                continue
            if hold:
                out.append((False, self._buf[:hold]))
                self._buf = self._buf[hold:]
            break
        return out

    def _partial_start(self) -> int:
        """Where the earliest incomplete marker may begin (len(buf) if none)."""
        n = len(self._buf)
        for j in range(max(0, n - self._longest + 1), n):
            if self._buf[j:] in self._prefixes:
                return j
        return n
