"""`pdserve bench`'s workloads: the --dataset flags, their checks, and what each level sends.

    random                    --input-len tokens, --output-len out          (--num-prompts a level)
    sharegpt FILE             first human turns of the file                 (--num-prompts a level)
    generated-shared-prefix   --gsp-num-groups x --gsp-prompts-per-group requests a level, a group's
                              prompts sharing a --gsp-system-prompt-len system prompt, each with its
                              own --gsp-question-len question; --gsp-output-len out (SGLang's names)
    multi-turn                --num-prompts conversations a level, --num-turns turns each: an
                              --input-len first prompt, then the answer (--output-len) and a new
                              --question-len question appended each turn (multiturn.py)
    agentic                   --num-prompts coding-agent sessions a level sharing a system prefix, each
                              turn appending the answer and a tool output until the context cap
                              (the --agentic-* flags; agentic.py)

The token-id workloads go to /v1/completions only (a chat message is text).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bench import agentic, dataset

DATASETS = ("random", "sharegpt", "generated-shared-prefix", "multi-turn", "agentic")
CONVERSATIONS = ("multi-turn", "agentic")  # sent by multiturn.py
DEFAULT_NUM_PROMPTS = [6, 24, 32]

Workload = list[dataset.BenchRequest] | list[dataset.Conversation]
MakeWorkload = Callable[[int, random.Random], Workload]


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        nargs="+",
        default=["random"],
        metavar="NAME [FILE]",
        help="random (token ids), sharegpt FILE, generated-shared-prefix, multi-turn, or agentic",
    )
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (random; multi-turn: the first turn's)")
    p.add_argument(
        "--output-len", type=int, default=256, help="generated tokens per request (max_tokens with ignore_eos)"
    )
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--question-len", type=int, default=64, help="multi-turn: new tokens each later turn adds")
    p.add_argument("--gsp-num-groups", type=int, default=8, help="generated-shared-prefix: groups (system prompts)")
    p.add_argument("--gsp-prompts-per-group", type=int, default=8, help="generated-shared-prefix: requests a group")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="generated-shared-prefix: shared tokens")
    p.add_argument("--gsp-question-len", type=int, default=128, help="generated-shared-prefix: tokens of each question")
    p.add_argument("--gsp-output-len", type=int, default=256, help="generated-shared-prefix: generated tokens")
    agentic.add_agentic_args(p)


def check_dataset(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag at fault; fills --num-prompts' default."""
    kind = args.dataset[0]
    if kind not in DATASETS:
        raise ValueError(
            f"unknown dataset {kind!r}: expected random, sharegpt FILE, generated-shared-prefix, multi-turn or agentic"
        )
    if kind == "sharegpt" and len(args.dataset) != 2:
        raise ValueError("--dataset sharegpt needs its JSON file: --dataset sharegpt FILE")
    if kind != "sharegpt" and len(args.dataset) != 1:
        raise ValueError(f"--dataset {kind} takes no file")
    if kind == "generated-shared-prefix":
        if args.num_prompts is not None:
            raise ValueError(
                "--dataset generated-shared-prefix sends --gsp-num-groups x --gsp-prompts-per-group requests a level; "
                "drop --num-prompts"
            )
        args.num_prompts = [args.gsp_num_groups * args.gsp_prompts_per_group] * len(args.concurrency)
    elif args.num_prompts is None:
        args.num_prompts = DEFAULT_NUM_PROMPTS
    sizes = ("input_len", "output_len", "num_turns", "question_len", "gsp_num_groups", "gsp_prompts_per_group")
    sizes += ("gsp_system_prompt_len", "gsp_question_len", "gsp_output_len")
    for name in sizes:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if kind == "agentic":
        agentic.shape_from_args(args)
    if kind in ("generated-shared-prefix", *CONVERSATIONS) and args.endpoint.endswith("/chat/completions"):
        raise ValueError(f"--dataset {kind} sends token ids: use --endpoint /v1/completions")


def prompt_source(
    args: argparse.Namespace, model: str, models: list[dict[str, Any]]
) -> tuple[MakeWorkload, dict | None]:
    """make(num, rng) -> one level's workload, and the random vocabulary's description for the report."""
    kind = args.dataset[0]
    if kind == "sharegpt":
        prompts = dataset.load_sharegpt(args.dataset[1])
        return lambda num, rng: dataset.sharegpt_requests(prompts, num, args.output_len, rng), None
    card = next((m for m in models if m.get("id") == model), {})
    root = card.get("root")
    limit = card.get("max_model_len")
    if kind == "agentic" and limit and args.agentic_max_context > limit:  # every long session's last turns would fail
        raise ValueError(f"--agentic-max-context {args.agentic_max_context} passes {model}'s max_model_len {limit}")
    vocab = dataset.load_vocab([args.tokenizer, root, model])  # the model card's root is its checkpoint folder
    if vocab.tokenizer is None:
        print(f"note: no tokenizer found, random token ids from 0..{vocab.size - 1}; pass --tokenizer", file=sys.stderr)

    def make(num: int, rng: random.Random) -> Workload:
        if kind == "agentic":
            return agentic.sessions(num, agentic.shape_from_args(args), vocab, rng)
        if kind == "multi-turn":
            a = args
            return dataset.conversations(num, a.num_turns, a.input_len, a.question_len, a.output_len, vocab, rng)
        if kind == "generated-shared-prefix":
            a = args
            return dataset.shared_prefix_requests(
                a.gsp_num_groups, a.gsp_prompts_per_group, a.gsp_system_prompt_len, a.gsp_question_len,
                a.gsp_output_len, vocab, rng,
            )  # fmt: skip
        return dataset.random_requests(num, args.input_len, args.output_len, vocab, rng)

    return make, {"size": vocab.size, "excluded": len(vocab.excluded), "tokenizer": vocab.tokenizer}
