"""Benchmark prompts: random token ids (exact lengths), ShareGPT conversations, and the two
prefix-cache workloads (agentic sessions, built on `Conversation`, are agentic.py's).

Random prompts are token-id lists sent as the `prompt` of /v1/completions, the
way `vllm bench serve --dataset-name random` does, so the server sees exactly
`input_len` tokens without a tokenizer round trip. Ids are drawn from the
tokenizer's base vocabulary with its special tokens left out.

    generated-shared-prefix   SGLang bench_serving's: G groups x M requests; a group's requests share
                              one S-token system prompt and each adds its own Q-token question
    multi-turn                conversations of T turns sent one after another: turn k+1's prompt is
                              turn k's prompt + turn k's answer (its token ids) + a new Q-token
                              question, as a chat client resends the conversation so far
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

# Without a tokenizer to size the vocabulary, draw from the byte range: every
# byte-level BPE vocabulary (DeepSeek's included) holds these ids.
FALLBACK_VOCAB_SIZE = 256


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (random) or text (sharegpt)
    output_len: int  # max_tokens; with ignore_eos the exact output length


@dataclass(frozen=True)
class Vocab:
    size: int  # ids are drawn from [0, size)
    excluded: frozenset[int]  # special token ids inside that range
    tokenizer: str | None  # the tokenizer.json that sized it; None: the byte-range fallback


def find_tokenizer_file(path: str | None) -> str | None:
    """tokenizer.json at `path` (a file, or a folder holding one), else None."""
    if not path:
        return None
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    return candidate if os.path.isfile(candidate) else None


def load_vocab(tokenizer_paths: list[str | None]) -> Vocab:
    """The vocabulary of the first path that holds a tokenizer.json."""
    for path in tokenizer_paths:
        tokenizer_file = find_tokenizer_file(path)
        if tokenizer_file is None:
            continue
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_file)
        size = tokenizer.get_vocab_size(with_added_tokens=False)
        special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        return Vocab(size, frozenset(i for i in special if i < size), tokenizer_file)
    return Vocab(FALLBACK_VOCAB_SIZE, frozenset(), None)


@dataclass(frozen=True)
class Conversation:
    """A chain of turns: the first turn's prompt, then what each later turn appends after the
    previous answer (a question; an agent's tool output); the answers are the server's (multiturn.py)."""

    first: list[int]
    appended: list[list[int]]  # one per turn after the first
    output_lens: list[int]  # each turn's answer (max_tokens), one per turn
    think_s: list[float] = field(default_factory=list)  # s before each later turn is sent; empty: none

    @property
    def turns(self) -> int:
        return 1 + len(self.appended)

    def think(self, turn: int) -> float:
        """Seconds to wait after turn - 1's answer before sending `turn` (>= 1)."""
        return self.think_s[turn - 1] if self.think_s else 0.0


def allowed_ids(vocab: Vocab) -> list[int]:
    """The ids prompts are drawn from: the base vocabulary less its special tokens."""
    allowed = [i for i in range(vocab.size) if i not in vocab.excluded]
    if not allowed:
        raise ValueError(f"vocabulary from {vocab.tokenizer} has no usable token ids")
    return allowed


def _ids(allowed: list[int], n: int, rng: random.Random) -> list[int]:
    return [rng.choice(allowed) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, vocab: Vocab, rng: random.Random) -> list[BenchRequest]:
    allowed = allowed_ids(vocab)
    return [BenchRequest(_ids(allowed, input_len, rng), output_len) for _ in range(num)]


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    vocab: Vocab,
    rng: random.Random,
) -> list[BenchRequest]:
    """num_groups x prompts_per_group requests, groups interleaved in a seeded shuffle; each prompt is
    its group's system prompt followed by its own question."""
    allowed = allowed_ids(vocab)
    systems = [_ids(allowed, system_prompt_len, rng) for _ in range(num_groups)]
    requests = [
        BenchRequest(system + _ids(allowed, question_len, rng), output_len)
        for system in systems
        for _ in range(prompts_per_group)
    ]
    rng.shuffle(requests)
    return requests


def conversations(
    num: int, turns: int, input_len: int, question_len: int, output_len: int, vocab: Vocab, rng: random.Random
) -> list[Conversation]:
    """num conversations of `turns` turns: an input_len-token first prompt, question_len-token questions."""
    allowed = allowed_ids(vocab)
    return [
        Conversation(
            _ids(allowed, input_len, rng),
            [_ids(allowed, question_len, rng) for _ in range(turns - 1)],
            [output_len] * turns,
        )
        for _ in range(num)
    ]


def load_sharegpt(path: str) -> list[str]:
    """First human turn of every conversation that has one (ShareGPT JSON layout)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from e
    prompts = []
    for entry in data if isinstance(data, list) else []:
        turns = entry.get("conversations") or entry.get("conversation") or []
        for turn in turns:
            if turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
                prompts.append(str(turn["value"]))
                break
    if not prompts:
        raise ValueError(f"{path} holds no ShareGPT conversations with a human turn")
    return prompts


def sharegpt_requests(prompts: list[str], num: int, output_len: int, rng: random.Random) -> list[BenchRequest]:
    """`num` prompts sampled without replacement (with it, if the file holds fewer)."""
    picked = rng.sample(prompts, num) if num <= len(prompts) else [rng.choice(prompts) for _ in range(num)]
    return [BenchRequest(p, output_len) for p in picked]
