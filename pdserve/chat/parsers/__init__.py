"""The response side of DeepSeek's chat protocol: reasoning and tool calls out of generated text.

vLLM's names: `--reasoning-parser deepseek_v4 | deepseek_r1`, `--tool-call-parser deepseek_v4 |
deepseek_v32 | deepseek_v31 | deepseek_v3`; `auto` (the default) picks by the checkpoint
(`default_parsers`), `none` turns one off. Both reasoning parsers read `<think>` / `</think>`;
whether an answer starts in its reasoning is the prompt's to say (the validator's
`Prepared.thinking`): thinking mode ends the prompt with `<think>`, chat mode with `</think>`; a
prompt that ends with neither (R1's first template, V3) leaves it to the output: one that starts
with `<think>` reasons first.

    scan.py         streamed text -> text and markers, holding back a marker's possible start
    dialects.py     each family's tool-call markup: its markers, and its two readers of a call's body
    calls.py        one call's whole body -> name + JSON arguments
    partial.py      one call's body as it streams -> its name, the start of its arguments
    json_prefix.py  a JSON object's text as it streams -> the part sure to stand
    output.py       OutputParser: one choice's text -> reasoning, content, tool calls (given out
                    from their heads, arguments as they are written)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.chat.parsers.dialects import DIALECTS
from pdserve.chat.parsers.output import CallEnd, CallPiece, OutputParser, Parsed, ToolCall

REASONING_PARSERS = ("deepseek_v4", "deepseek_r1")
TOOL_PARSERS = tuple(DIALECTS)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "CallEnd",
    "CallPiece",
    "OutputParser",
    "OutputSpec",
    "Parsed",
    "ToolCall",
]


def default_parsers(model_type: str | None, chat_template: str | None) -> tuple[str | None, str | None]:
    """(reasoning parser, tool-call parser) for a checkpoint: its config.json model_type, and for
    the V3 family (V3, R1, V3.1 share the model_type) its chat template's call format."""
    if model_type == "deepseek_v4":
        return "deepseek_v4", "deepseek_v4"
    if model_type == "deepseek_v32":
        return "deepseek_r1", "deepseek_v32"
    if model_type == "deepseek_v3":
        template = chat_template if isinstance(chat_template, str) else ""
        v31 = "tool▁sep" in template and "```json" not in template  # V3.1 writes bare JSON arguments
        return "deepseek_r1", "deepseek_v31" if v31 else "deepseek_v3"
    return None, None


def resolve(setting: str, default: str | None) -> str | None:
    """A configured parser name: auto -> the model's default, none -> None."""
    return default if setting == "auto" else None if setting == "none" else setting


@dataclass(frozen=True)
class OutputSpec:
    """How one chat request's output is read (made by the router per request)."""

    reasoning_parser: str | None  # None: no reasoning_content, think tags are text
    tool_parser: str | None  # None: no calls parsed (no tools, tool_choice "none", or no parser)
    tool_names: frozenset[str] = frozenset()
    thinking: bool = False  # the prompt ends in thinking mode
    drop: frozenset[str] = field(default_factory=frozenset)  # special tokens' texts removed from the answer

    def parser(self) -> OutputParser:
        return OutputParser(
            reasoning=self.reasoning_parser is not None,
            thinking=self.thinking,
            dialect=DIALECTS[self.tool_parser] if self.tool_parser is not None else None,
            tool_names=self.tool_names,
            drop=self.drop,
        )

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None


def tool_names(tools: Collection[dict] | None) -> frozenset[str]:
    """The function names of an OpenAI `tools` list (entries of any other form name nothing)."""
    names = set()
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else getattr(t, "function", None)
        name = fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", None)
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)
