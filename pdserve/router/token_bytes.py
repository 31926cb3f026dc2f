"""A token's own bytes, for logprobs' `bytes`: a byte-level BPE token may be part of a UTF-8
character (its text alone is U+FFFD), so its bytes come from the piece, not from its decoded text.

    byte-level BPE (GPT-2's alphabet: each byte is one printable character, a space is "Ġ"):
        the piece's characters mapped back to their bytes ("ä" "¸" "Ń" -> e4 b8 ad, "中")
    a piece outside that alphabet (an added token such as <｜end▁of▁sentence｜>): its UTF-8
    SentencePiece byte fallback "<0xE4>": that byte; otherwise the decoded text's UTF-8
"""

from __future__ import annotations

import re
from functools import lru_cache

from pdserve.tokenizer import Tokenizer

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_OF = _byte_level_alphabet()


class TokenBytes:
    """token id -> its bytes, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        space = tokenizer.encode(" ", add_special_tokens=False)
        self.byte_level = len(space) == 1 and tokenizer.id_to_token(space[0]) == "Ġ"
        self.of = lru_cache(maxsize=4096)(self._bytes)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self.byte_level and all(c in BYTE_OF for c in piece):
            return [BYTE_OF[c] for c in piece]
        if piece is not None and (m := BYTE_FALLBACK.fullmatch(piece)):
            return [int(m[1], 16)]
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode())
