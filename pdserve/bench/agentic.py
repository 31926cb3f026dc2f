"""The agentic workload (`--dataset agentic`): coding-agent sessions whose context grows through
tool outputs, every turn resending all of it, so most of each prompt is the previous one.

    shared prefix     --agentic-system-len tokens: the system prompt and tool schemas, the same for
                      every session of a level
    turn 0 prompt     shared prefix + the session's own --agentic-task-len task
    turn k+1 prompt   turn k's prompt + turn k's answer (the server's token ids) + a tool output of
                      --agentic-tool-output-len MIN MAX tokens, sent --agentic-think-time MIN MAX
                      seconds after the answer (the tool runs, the agent reads)
    answers           --agentic-output-len MIN MAX tokens (max_tokens with ignore_eos: exact)
    end               the turn before the one whose context (prompt + answer) would pass
                      --agentic-max-context

Lengths are uniform in their ranges; lengths, ids and think times come from the level's seeded
random stream, so a seed gives the same sessions on every run. Sessions are `Conversation`s, sent
by multiturn.py (at most --concurrency in flight, arriving at --request-rate sessions/s).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pdserve.bench.dataset import Conversation, Vocab, allowed_ids


@dataclass(frozen=True)
class AgenticShape:
    system_len: int  # the shared prefix: system prompt and tool schemas
    task_len: int  # each session's first user message
    tool_output_len: tuple[int, int]  # inclusive range of each later turn's tool output
    output_len: tuple[int, int]  # inclusive range of each answer
    max_context: int  # no turn's prompt + answer passes it
    think_s: tuple[float, float]  # range of the wait before each later turn

    def check(self) -> None:
        """Raises ValueError naming the flag at fault."""
        for flag, value in (("system-len", self.system_len), ("task-len", self.task_len)):
            if value <= 0:
                raise ValueError(f"--agentic-{flag} must be positive")
        ranges = (("tool-output-len", self.tool_output_len, 1), ("output-len", self.output_len, 1))
        for flag, (lo, hi), least in (*ranges, ("think-time", self.think_s, 0)):
            if lo < least or hi < lo:
                raise ValueError(f"--agentic-{flag} MIN MAX: want {least} <= MIN <= MAX, got {lo} {hi}")
        first = self.system_len + self.task_len + self.output_len[1]
        if first > self.max_context:
            raise ValueError(
                f"--agentic-max-context {self.max_context} is below a first turn's context (system + task + "
                f"the longest answer = {first})"
            )


def add_agentic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agentic-system-len", type=int, default=8192, help="agentic: shared system prompt + tool schemas")
    p.add_argument("--agentic-task-len", type=int, default=512, help="agentic: tokens of each session's first message")
    p.add_argument(
        "--agentic-tool-output-len", type=int, nargs=2, default=[1024, 8192], metavar=("MIN", "MAX"),
        help="agentic: tokens of the tool output each later turn appends",
    )  # fmt: skip
    p.add_argument(
        "--agentic-output-len", type=int, nargs=2, default=[100, 600], metavar=("MIN", "MAX"),
        help="agentic: tokens generated per turn",
    )  # fmt: skip
    p.add_argument(
        "--agentic-max-context", type=int, default=65536, help="agentic: a session ends before a turn would pass it"
    )
    p.add_argument(
        "--agentic-think-time", type=float, nargs=2, default=[0.5, 2.0], metavar=("MIN", "MAX"),
        help="agentic: seconds between an answer and the next turn",
    )  # fmt: skip


def shape_from_args(args: argparse.Namespace) -> AgenticShape:
    shape = AgenticShape(
        args.agentic_system_len, args.agentic_task_len, tuple(args.agentic_tool_output_len),
        tuple(args.agentic_output_len), args.agentic_max_context, tuple(args.agentic_think_time),
    )  # fmt: skip
    shape.check()
    return shape


def sessions(num: int, shape: AgenticShape, vocab: Vocab, rng: random.Random) -> list[Conversation]:
    """`num` sessions sharing one system prefix, each growing until its next turn would pass the cap."""
    allowed = allowed_ids(vocab)
    prefix = rng.choices(allowed, k=shape.system_len)
    return [_session(prefix, shape, allowed, rng) for _ in range(num)]


def _session(prefix: list[int], shape: AgenticShape, allowed: list[int], rng: random.Random) -> Conversation:
    first = prefix + rng.choices(allowed, k=shape.task_len)
    outputs = [rng.randint(*shape.output_len)]
    context = len(first) + outputs[0]  # what the KV holds after turn 0's answer
    tools: list[list[int]] = []
    think: list[float] = []
    while True:
        tool, out = rng.randint(*shape.tool_output_len), rng.randint(*shape.output_len)
        if context + tool + out > shape.max_context:
            break
        context += tool + out
        tools.append(rng.choices(allowed, k=tool))  # choices, not choice per id: ~10x faster at 64K tokens
        outputs.append(out)
        think.append(rng.uniform(*shape.think_s))
    return Conversation(first, tools, outputs, think)
