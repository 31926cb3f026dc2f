"""The DeepSeek families' tool-call markup, one `Dialect` each (vLLM's --tool-call-parser names):
the markers of a call block and of a call, how a call's whole body parses (calls.py) and how it
reads as it streams (partial.py)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from pdserve.chat.parsers.calls import DSML, Call, parse_dsml, parse_v3, parse_v31
from pdserve.chat.parsers.partial import DsmlArgs, V3Args, V31Args


class ArgsReader(Protocol):
    """One call's body as it streams (partial.py)."""

    name: str | None  # the call's name, once its head is whole

    def feed(self, text: str) -> str:
        """The body's next text -> the arguments text it made certain (none before the head)."""
        ...


@dataclass(frozen=True)
class Dialect:
    block_open: tuple[str, ...]  # the first that matches at a place is the longest
    call_open: str
    call_close: str
    block_close: str
    parse: Callable[[str, Collection[str]], Call]
    reader: Callable[[], ArgsReader]

    def markers(self) -> set[str]:
        return {*self.block_open, self.call_open, self.call_close, self.block_close}


_V3_MARKERS = dict(
    block_open=("<｜tool▁calls▁begin｜>",),
    call_open="<｜tool▁call▁begin｜>",
    call_close="<｜tool▁call▁end｜>",
    block_close="<｜tool▁calls▁end｜>",
)


def _dsml(block: str) -> Dialect:
    return Dialect(
        block_open=(f"\n\n<{DSML}{block}>", f"<{DSML}{block}>"),
        call_open=f"<{DSML}invoke",
        call_close=f"</{DSML}invoke>",
        block_close=f"</{DSML}{block}>",
        parse=parse_dsml,
        reader=DsmlArgs,
    )


DIALECTS: dict[str, Dialect] = {
    "deepseek_v4": _dsml("tool_calls"),
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v31": Dialect(**_V3_MARKERS, parse=parse_v31, reader=V31Args),
    "deepseek_v3": Dialect(**_V3_MARKERS, parse=parse_v3, reader=V3Args),
}
