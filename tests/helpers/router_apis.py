"""What the router API tests share (chat, Anthropic's Messages, OpenAI's Responses): worker
chunks to feed a formatter, a DeepSeek-V4 request validator, and a tiny V4 PD cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.router.validation import RequestValidator
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.protocol import GenerateChunk
from tests.helpers.cluster import Cluster

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}}  # fmt: skip


def worker_chunks(
    pieces: list[str], finish: str = "stop", stop_reason: int | str | None = None, cached: int = 0
) -> list[GenerateChunk]:
    """One worker chunk per piece, one token each; the first says how much of the prompt was cached."""
    out, at = [], 0
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(
            GenerateChunk(
                request_id="r",
                token_offset=i,
                token_ids=[7],
                text_offset=at,
                text=piece,
                finish_reason=finish if last else None,
                stop_reason=stop_reason if last else None,
                num_cached_tokens=cached if i == 0 else 0,
            )
        )
        at += len(piece)
    return out


def v4_validator(model_dir: str) -> RequestValidator:
    """The router's validator for a tiny V4 checkpoint, with the tool parser it sets for V4."""
    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    v = RequestValidator(Tokenizer(model_dir), "tiny", vocab)
    v.tool_parser = "deepseek_v4"
    return v


@contextmanager
def v4_pd_cluster(root: Path, api_key: str) -> Iterator[Cluster]:
    """A tiny V4 behind prefill + decode workers (16-token blocks) and a router with `api_key`:
    `c.main` the router, `c.workers` the two workers, every process healthy."""
    with Cluster(make_tiny_model(root / "tiny", arch="deepseek_v4", seed=0), root / "logs") as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", peers=[prefill])
        c.main = c.router("--api-key", api_key, prefill=[prefill], decode=[decode])
        c.workers = [prefill, decode]
        c.wait_healthy()
        yield c
