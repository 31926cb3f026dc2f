"""What the router believes each worker holds in its prefix cache: an approximate radix tree per
worker, kept from the prompts routed there (nothing is asked of the workers).

The tree is stored as its paths: a prompt's token ids are cut into CHUNK_TOKENS-token chunks, and
chunk k is named by a hash chained over chunks 0..k (as the engines name KV blocks), so a name
stands for the whole prefix up to its chunk and one dict lookup per chunk walks the tree:

    prompt  [t0 .. t15][t16 .. t31][t32 .. t47][t48 t49]     (the partial chunk is not kept)
    names   h0 = H(t0..t15)  h1 = H(h0, t16..t31)  h2 = H(h1, t32..t47)
    match   the leading names a worker's tree holds, in tokens: 48 if it holds h0, h1, h2

Bounded: at most `max_tokens` tokens per worker; past that the least recently used chunks go
first. A prompt refreshes its chunks deepest first, so a prefix's root is always younger than its
branches and eviction cuts leaves before the trunk they hang from (what a worker's own LRU does).
The names are Python hashes of int tuples (not salted per process, unlike str); a collision can
only misroute one request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CHUNK_TOKENS = 16  # tokens a tree node stands for: the finest match the router tells apart


def chunk_names(prompt: Sequence[int]) -> list[int]:
    """The chained names of the prompt's full chunks, root first."""
    names: list[int] = []
    parent = 0
    for start in range(0, len(prompt) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        parent = hash((parent, *prompt[start : start + CHUNK_TOKENS]))
        names.append(parent)
    return names


class PrefixTree:
    """One worker's tree: chunk names in least-recently-used order."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < CHUNK_TOKENS:
            raise ValueError(f"a prefix tree must hold at least one chunk ({CHUNK_TOKENS} tokens), got {max_tokens}")
        self.max_chunks = max_tokens // CHUNK_TOKENS
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def tokens(self) -> int:
        return len(self._lru) * CHUNK_TOKENS

    def match(self, names: Sequence[int]) -> int:
        """Tokens of the longest prefix of `names` this tree holds."""
        n = 0
        for name in names:
            if name not in self._lru:
                break
            n += 1
        return n * CHUNK_TOKENS

    def insert(self, names: Sequence[int]) -> None:
        """Record a routed prompt: its chunks become the most recent, then the oldest are evicted."""
        lru = self._lru
        for name in reversed(names):
            lru[name] = None
            lru.move_to_end(name)
        while len(lru) > self.max_chunks:
            lru.popitem(last=False)
