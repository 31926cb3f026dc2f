"""Incremental detokenization per token: `IncrementalDetokenizer` on tokenizers' DecodeStream
against its Python path (the same cut and the same hold-back of partial UTF-8 characters, two
decodes a token), on the same token streams; both must give the same text, or it exits 1.

    python -m benchmarks.engine.bench_detokenize [--tokens 20000] [--repeat 5]

Streams: English and multi-byte text (characters split across byte tokens) and random ids (what a
random-weight model emits: invalid UTF-8 and special tokens), each through the tiny model's
tokenizer (byte-level BPE, 857 tokens) and through a byte-level BPE with DeepSeek's 129280-token
vocabulary (benchmarks/engine/bench_structured.py's). Prints microseconds per token (best of
--repeat runs).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Café, naïve, Zürich; 中文的句子，日本語のテキスト 😀👍🏽 → ∑ "


def tokenizers(tmp: Path) -> dict[str, Tokenizer]:
    from benchmarks.engine.bench_structured import VOCAB, synthetic_tokenizer_json

    big = make_tiny_model(tmp / "big")
    (big / "tokenizer.json").write_text(synthetic_tokenizer_json(VOCAB))
    return {"tiny (857)": Tokenizer(make_tiny_model(tmp / "tiny")), "byte-level 129280": Tokenizer(big)}


def streams(tok: Tokenizer, n: int) -> dict[str, list[int]]:
    text = tok.encode(TEXT * (1 + 4 * n // len(TEXT)), add_special_tokens=False)[:n]
    rng = random.Random(0)
    return {"text": text, "random ids": [rng.randrange(tok.vocab_size) for _ in range(n)]}


def run(tok: Tokenizer, prompt: list[int], ids: list[int], use_stream: bool) -> tuple[float, str]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, use_stream=use_stream)
    t0 = time.perf_counter()
    pieces = [detok.push(t) for t in ids]
    seconds = time.perf_counter() - t0
    return seconds, "".join(pieces) + detok.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        toks = tokenizers(Path(tmp))
    print("| tokenizer | stream | Python path (us / token) | DecodeStream (us / token) | speed-up |")
    print("| --- | --- | ---: | ---: | ---: |")
    same = True
    for name, tok in toks.items():
        prompt = tok.encode("Tell me a story.")
        for what, ids in streams(tok, args.tokens).items():
            us = {}
            for use_stream in (False, True):
                runs = [run(tok, prompt, ids, use_stream) for _ in range(args.repeat)]
                us[use_stream] = 1e6 * min(s for s, _ in runs) / len(ids)
                us[use_stream, "text"] = runs[0][1]
            same &= us[False, "text"] == us[True, "text"]
            print(f"| {name} | {what} | {us[False]:.2f} | {us[True]:.2f} | {us[False] / us[True]:.1f}x |", flush=True)
    if not same:
        print("the two paths gave different text", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
