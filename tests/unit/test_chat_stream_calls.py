"""Tool calls streamed as they are written, in every call format: seeded random tools and arguments
(unicode, quotes, backslashes, control characters, numbers, nested JSON; JSON laid out as models
write it), fed in random pieces and cut at random characters. A complete call's pieces join into the
arguments of the whole text's parse (and those read back as the values written); a cut call's are
the start of them and read as partial JSON; no reasoning or content ever holds markup. The JSON
reader that certifies the V3 formats' arguments is checked on its own at the end."""

from __future__ import annotations

import json
import random

import pytest
from pydantic_core import from_json

from pdserve.chat.dsv4 import dsml_tool_calls
from pdserve.chat.parsers.json_prefix import JsonPrefix
from tests.unit.test_chat_parsers import parse, random_pieces, spec

pytestmark = pytest.mark.timeout(300)

NAMES = ["get_weather", "search", "计算", "a.b-c_d", "x"]
STRINGS = ["", "Paris", '"quoted"', "back\\slash", "\\n not a newline", "tab\there", "line\nbreak", "北京 🇫🇷",
           "e\u0301", "\x01\x1f", "}{][,:", "</", "<｜", "｜", "{\"json\": [1]}", "\\u00e9", " ", "\u2028"]  # fmt: skip
MARKERS = ("｜DSML｜", "<｜tool▁", "<think>", "</think>")


def value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice(STRINGS) for _ in range(rng.randint(0, 4)))
    if kind == "int":
        return rng.choice([0, -1, 7, 10**20, -(10**15)])
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 3.0e21, rng.uniform(-1e6, 1e6)])
    if kind in ("bool", "null"):
        return {"bool": rng.random() < 0.5, "null": None}[kind]
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(STRINGS) + str(i): value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def calls(rng: random.Random) -> list[tuple[str, dict]]:
    return [
        (rng.choice(NAMES), {"p" + str(i) + rng.choice(["", "é", " x"]): value(rng) for i in range(rng.randint(0, 4))})
        for _ in range(rng.randint(1, 3))
    ]


def as_json(rng: random.Random, args: dict) -> str:
    """A JSON object as a model may lay it out."""
    layout = rng.choice([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": True}])
    return json.dumps(args, ensure_ascii=layout.pop("ensure_ascii", False), **layout)


def written(rng: random.Random, dialect: str, made: list[tuple[str, dict]]) -> str:
    """An answer with text and then the calls in `dialect`'s markup."""
    text = rng.choice(["", "Let me check.", "北京?"])
    if dialect in ("deepseek_v4", "deepseek_v32"):
        block = dsml_tool_calls([{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in made])
        return text + (block if dialect == "deepseek_v4" else block.replace("tool_calls>", "function_calls>"))
    if dialect == "deepseek_v31":
        body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{as_json(rng, a)}<｜tool▁call▁end｜>" for n, a in made)
    else:
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{as_json(rng, a)}\n```<｜tool▁call▁end｜>"
            for n, a in made
        )
    return f"{text}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


@pytest.mark.parametrize("dialect", ["deepseek_v4", "deepseek_v32", "deepseek_v31", "deepseek_v3"])
def test_streamed_arguments_join_into_the_whole_calls_and_a_cut_keeps_a_start(dialect):
    """parse() itself checks that each call's head comes first and its pieces join into the
    arguments it ends with; here those arguments are held to the whole text's."""
    rng = random.Random(4200 + len(dialect))
    s = spec(tools=NAMES, thinking=False, reasoning="deepseek_r1", tool_parser=dialect)
    for _ in range(60):
        made = calls(rng)
        text = written(rng, dialect, made)
        whole = parse(text, s)
        _, content, got, failures = whole
        assert failures == [] and [(n, json.loads(a)) for n, a in got] == made, text
        for _ in range(3):
            assert parse(text, s, random_pieces(rng, text)) == whole
        for k in sorted(rng.sample(range(len(text) + 1), 15)):
            reasoning, content, cut, failures = parse(text[:k], s, random_pieces(rng, text[:k]), cut=True)
            assert not any(m in reasoning + content for m in MARKERS), text[:k]
            done = [c for c in cut if len(c) == 2]
            assert done == got[: len(done)]
            if len(cut) > len(done):
                name, arguments, reason = cut[-1]
                assert (name, reason) == (got[len(done)][0], "cut_call") and got[len(done)][1].startswith(arguments)
                if arguments:
                    from_json(arguments, allow_partial=True)  # as the anthropic client reads the pieces


JSON_TEXTS = [
    '{"a": 1}',
    '{"a":[1,2.5e-3,{"b":null}],"c":"x\\\\y\\"z"}',
    "{}",
    ' {\n  "k": true\n} ',
    '{"u": "\\u00e9"}',
]
NOT_JSON = {
    '{"a": nope}': '{"a": ',
    '{"a": 1e}': '{"a": ',
    '{"a": 01}': '{"a": ',
    '{"a": "\x01"}': '{"a": "',
    '{"a": "\\x"}': '{"a": "',
    "[1, 2]": "",
    '{"a": 1} x': '{"a": 1} ',
    '{"a" 1}': '{"a" ',
    '{"a": tru}': '{"a": ',
    "{,}": "{",
}


def test_json_prefix_gives_out_only_what_stands():
    rng = random.Random(9)
    texts = JSON_TEXTS + [as_json(rng, {"k": value(rng)}) for _ in range(300)]
    for text in texts:
        reader, given = JsonPrefix(), ""
        for piece in random_pieces(rng, text):
            given += reader.feed(piece)
            assert text.startswith(given)
            if given.strip():
                from_json(given, allow_partial=True)
        assert reader.ok and given == text, text  # a whole object: all of it, once it ends
    for text, stands in NOT_JSON.items():
        reader = JsonPrefix()
        given = "".join(reader.feed(ch) for ch in text)
        assert (given, reader.ok) == (stands, False), text
