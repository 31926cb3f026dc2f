"""The response side of DeepSeek's chat protocol (pdserve/chat/parsers): reasoning_content and tool
calls out of model text, whole and streamed in random pieces, and malformed markup kept as text.

The texts are what an assistant turn encodes to (pdserve/chat/dsv4.py, held to DeepSeek's
reference encoder by test_chat_dsv4.py), so parsing one must give the turn back; DeepSeek's own
parse example is checked with the values its test asserts."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.chat.dsv4 import EOS, encode
from pdserve.chat.parsers import CallPiece, OutputSpec, default_parsers, tool_names
from pdserve.chat.parsers.calls import parse_dsml
from pdserve.chat.parsers.dialects import DIALECTS
from pdserve.chat.parsers.scan import MarkerScanner

pytestmark = pytest.mark.timeout(120)

D = "｜DSML｜"
TOOLS = ["get_weather", "search", "write_file", "计算"]
# Text that a split may cut where it hurts: multi-code-point characters (a combining accent, a ZWJ
# emoji family, a flag), markup look-alikes, special tokens' text, newlines before a block.
WORDS = [
    "Paris",
    "e\u0301",
    "👨\u200d👩\u200d👧",
    "🇫🇷",
    "北京",
    "<",
    "</",
    "<think",
    "｜",
    "\n",
    "\n\n",
    " ",
    "{",
    '"',
    "x",
]

# DeepSeek's test case 1 (encoding/test_encoding_dsv4.py): the first assistant turn's text.
DEEPSEEK_EXAMPLE = (
    "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="location" string="true">Beijing</{D}parameter>\n'
    f'<{D}parameter name="unit" string="true">celsius</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)


def spec(tools=TOOLS, thinking=True, reasoning="deepseek_v4", tool_parser="deepseek_v4", drop=()):
    return OutputSpec(reasoning, tool_parser if tools else None, frozenset(tools), thinking, frozenset(drop))


def parse(text: str, s: OutputSpec, pieces: list[str] | None = None, cut: bool = False):
    """(reasoning, content, calls, failures) of text fed whole or in pieces (cut: the output ends as
    one cut by the length limit). `calls`: every call given out, in order, as (name, arguments) when
    complete, (name, the arguments given out, reason) when not. The events are checked on the way:
    a call's head comes first, its pieces join into its arguments, each call ends once."""
    p = s.parser()
    outs = [p.feed(x) for x in (pieces if pieces is not None else [text])] + [p.finish(cut)]
    said, given, ended = {"reasoning": "", "content": ""}, {}, []
    for e in (e for o in outs for e in o.events):
        if isinstance(e, tuple):
            said[e[0]] += e[1]
        elif isinstance(e, CallPiece) and e.id is not None:
            assert (e.index, e.arguments) == (len(given), "") and e.name and e.id.startswith("call_")
            given[e.index] = [e.name, ""]
        elif isinstance(e, CallPiece):
            assert e.arguments and e.index in given and e.index not in {t.index for t in ended}
            given[e.index][1] += e.arguments
        else:
            assert [e.call.name, e.call.arguments] == given[e.call.index]
            ended.append(e.call)
    assert [t.index for t in ended] == list(range(len(given)))  # every call given out ends, in order
    assert [t for o in outs for t in o.calls] == [t for t in ended if t.reason is None]
    assert [t for o in outs for t in o.incomplete] == [t for t in ended if t.reason is not None]
    reasoning, content = "".join(o.reasoning for o in outs), "".join(o.content for o in outs)
    assert (said["reasoning"], said["content"]) == (reasoning, content)
    calls = [(t.name, t.arguments) if t.reason is None else (t.name, t.arguments, t.reason) for t in ended]
    return reasoning, content, calls, p.failures


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-(10**12), 10**12)
    if kind == "float":
        return rng.uniform(-1e6, 1e6)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_turn(rng: random.Random) -> dict:
    text = lambda: "".join(rng.choice(WORDS + ["The answer is 42."]) for _ in range(rng.randint(0, 8))).strip("\n")
    calls = [
        {
            "type": "function",
            "function": {
                "name": rng.choice(TOOLS),
                "arguments": json.dumps({f"p{i}": random_value(rng) for i in range(rng.randint(0, 4))}),
            },
        }
        for _ in range(rng.choice([0, 0, 1, 2, 3]))
    ]
    return {"role": "assistant", "reasoning_content": text(), "content": text(), "tool_calls": calls or None}


def completion(turn: dict, thinking: bool) -> str:
    """The text the model writes for `turn` (the encoded turn after the prompt, less EOS)."""
    user = {"role": "user", "content": "hi", "tools": None}
    prompt = encode([user], thinking=thinking)
    whole = encode([user, turn], thinking=thinking, drop_thinking=False, add_generation_prompt=False)
    assert whole.startswith(prompt) and whole.endswith(EOS)
    return whole[len(prompt) : -len(EOS)]


def random_pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_deepseek_parse_examples():
    reasoning, content, calls, failures = parse(DEEPSEEK_EXAMPLE, spec())
    assert reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert content == "" and failures == []
    assert calls == [("get_weather", '{"location": "Beijing", "unit": "celsius"}')]  # the reference's own text
    # its cases 1 (last turn) and 2, with EOS as the model writes it (a special token, dropped)
    final = "Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently sunny "
    final += f"with a temperature of 22°C and 45% humidity.{EOS}"
    reasoning, content, calls, _ = parse(final, spec(drop=(EOS,)))
    assert reasoning == "Got the weather data. Let me format a nice response." and "22°C" in content and calls == []
    paris = f"The user asks about the capital of France. It is Paris.</think>The capital of France is Paris.{EOS}"
    assert parse(paris, spec(tools=(), drop=(EOS,))) == (
        "The user asks about the capital of France. It is Paris.",
        "The capital of France is Paris.",
        [],
        [],
    )


@pytest.mark.parametrize("thinking", [True, False])
def test_v4_round_trip_and_random_splits(thinking):
    rng = random.Random(28 + thinking)
    for _ in range(150):
        turn = random_turn(rng)
        text = completion(turn, thinking)
        whole = parse(text, spec(thinking=thinking))
        reasoning, content, calls, failures = whole
        assert failures == [], text
        assert reasoning == (turn["reasoning_content"] if thinking else "")
        assert content == turn["content"]
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn["tool_calls"] or []]
        assert [(n, json.loads(a)) for n, a in calls] == want
        for _ in range(4):
            assert parse(text, spec(thinking=thinking), random_pieces(rng, text)) == whole


def test_dsml_values_are_decoded_as_the_string_flag_says():
    body = (
        f' name="f">\n<{D}parameter name="s" string="true">[1, 2]</{D}parameter>\n'
        f'<{D}parameter name="n" string="false">[1, 2]</{D}parameter>\n'
    )
    call = parse_dsml(body, {"f"})
    assert json.loads(call.arguments) == {"s": "[1, 2]", "n": [1, 2]}
    assert call.arguments == '{"s": "[1, 2]", "n": [1, 2]}'  # json.dumps' separators; JSON values as written


# Markup that does not parse before a call is given out: it stays text, as the model wrote it.
MALFORMED = {
    "unknown_tool": f'<{D}tool_calls>\n<{D}invoke name="rm_rf">\n</{D}invoke>\n</{D}tool_calls>',
    "invoke_format": f'<{D}tool_calls>\n<{D}invoke nam="search">\n</{D}invoke>\n</{D}tool_calls>',
    "empty_block": f"<{D}tool_calls>\n</{D}tool_calls>",
    "stray_markup": f"oops </{D}invoke> here",
    "unclosed_block": f"text\n\n<{D}tool_calls>\n",
}
# ... and after: the call, given out from its head, ends incomplete with the arguments given so far;
# its markup (and its block's) is never text. (the text, its content, the call)
_SEARCH = f'<{D}tool_calls>\n<{D}invoke name="search">\n'
BROKEN = {
    "unclosed_call": (f'Sure.\n\n{_SEARCH}<{D}parameter name="q" string="true">x', "Sure.", '{"q": "x'),
    "bad_json": (f'{_SEARCH}<{D}parameter name="n" string="false">{{nope</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>', "", '{"n": '),
    "parameter_format": (f'{_SEARCH}<{D}parameter name="n">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>', "", ""),
    "duplicate_parameter": (
        f'A{_SEARCH}<{D}parameter name="q" string="true">a</{D}parameter>\n<{D}parameter name="q" string="true">b'
        f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>",
        "A",
        '{"q": "a"',
    ),
}  # fmt: skip


@pytest.mark.parametrize("reason", list(MALFORMED))
def test_malformed_markup_stays_text(reason):
    text = MALFORMED[reason]
    reasoning, content, calls, failures = parse("r</think>" + text, spec())
    assert (reasoning, content, calls) == ("r", text, [])
    assert failures == [reason]
    rng = random.Random(7)
    for _ in range(20):
        assert parse("r</think>" + text, spec(), random_pieces(rng, "r</think>" + text)) == (
            reasoning,
            content,
            calls,
            failures,
        )


@pytest.mark.parametrize("reason", list(BROKEN))
def test_a_call_broken_after_its_head_ends_incomplete(reason):
    text, content, arguments = BROKEN[reason]
    got = parse("r</think>" + text, spec())
    assert got == ("r", content, [("search", arguments, reason)], [reason])
    rng = random.Random(8)
    for _ in range(20):
        assert parse("r</think>" + text, spec(), random_pieces(rng, "r</think>" + text)) == got


@pytest.mark.parametrize("thinking", [True, False])
def test_an_output_cut_anywhere_never_shows_markup(thinking):
    """The length limit cuts a turn at any character: reasoning and content are prefixes of the
    turn's (no marker, no start of one), the calls are the complete ones before the cut, then the
    one being written if it was given out: its arguments so far the start of the whole call's
    ("cut_call"); fed whole or in any pieces."""
    rng = random.Random(61 + thinking)
    markers = ("｜DSML｜", "<think>", "</think>")
    for _ in range(60):
        turn = random_turn(rng)
        text = completion(turn, thinking)
        whole = parse(text, spec(thinking=thinking))[2]
        for k in sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 12))):
            got = parse(text[:k], spec(thinking=thinking), cut=True)
            reasoning, content, calls, failures = got
            assert not any(m in content or m in reasoning for m in markers), text[:k]
            assert turn["content"].startswith(content) and (turn["reasoning_content"] if thinking else "").startswith(
                reasoning
            ), text[:k]
            complete = [c for c in calls if len(c) == 2]
            assert complete == whole[: len(complete)], text[:k]
            if len(calls) > len(complete):  # the call being written: its arguments so far
                (name, arguments, reason), full = calls[-1], whole[len(complete)]
                assert len(calls) == len(complete) + 1 and reason == "cut_call" and name == full[0]
                assert full[1].startswith(arguments), (arguments, full)
            assert set(failures) <= {"cut_call"}, (failures, text[:k])
            assert parse(text[:k], spec(thinking=thinking), random_pieces(rng, text[:k]), cut=True) == got
    cut = BROKEN["unclosed_call"][0]
    assert parse("r</think>" + cut, spec(), cut=True) == (
        "r",
        "Sure.",
        [("search", '{"q": "x', "cut_call")],
        ["cut_call"],
    )
    before_head = cut[: cut.index("search")]
    assert parse("r</think>" + before_head, spec(), cut=True) == ("r", "Sure.", [], ["cut_call"])
    assert parse("r</think>" + before_head, spec()) == ("r", before_head, [], ["unclosed_call"])  # ended: text


def test_repeated_markup_parses_the_good_calls_and_keeps_the_rest():
    good = f'<{D}invoke name="search">\n<{D}parameter name="q" string="true">a</{D}parameter>\n</{D}invoke>'
    twice = f"</think>A\n\n<{D}tool_calls>\n<{D}tool_calls>\n{good}\n{good}\n</{D}tool_calls>\n\n<{D}tool_calls>\n{good}\n</{D}tool_calls>"
    reasoning, content, calls, failures = parse(twice, spec())
    assert calls == [("search", '{"q": "a"}')] * 3
    assert content == f"A\n\n<{D}tool_calls>\n<{D}tool_calls>" and failures == ["text_in_block"]


def test_calls_straight_after_reasoning_end_it():
    """V4 may open its calls without writing </think> (vLLM's deepseek_v4 reader allows it too)."""
    text = DEEPSEEK_EXAMPLE.replace("</think>", "")
    reasoning, content, calls, failures = parse(text, spec())
    assert reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert (content, failures, [n for n, _ in calls]) == ("", [], ["get_weather"])
    assert parse(text, spec(tools=()))[:2] == (text, "")  # no tools: nothing to call, all reasoning


def test_think_tags_never_reach_content():
    reasoning, content, calls, failures = parse("<think>a</think>b</think>c<think>d", spec(thinking=False))
    assert (reasoning, content) == ("a", "bcd") and failures == ["think_tag", "think_tag"]
    # chat mode: no reasoning; thinking mode cut before </think>: all reasoning
    assert parse("plain answer", spec(thinking=False))[:2] == ("", "plain answer")
    assert parse("still thinking", spec(thinking=True))[:2] == ("still thinking", "")
    # R1's first template: the answer opens its reasoning itself (after a dropped special token)
    assert parse(" <｜User｜>\n<think>a</think>b", spec(thinking=False, drop=("<｜User｜>",)))[:2] == ("a", "b")
    # no reasoning parser: think tags are text
    assert parse("<think>a</think>b", spec(reasoning=None, thinking=False))[:2] == ("", "<think>a</think>b")


def test_tool_choice_none_or_no_parser_leaves_markup_as_text():
    reasoning, content, calls, failures = parse(DEEPSEEK_EXAMPLE, spec(tools=()))
    assert calls == [] and failures == [] and content.startswith(f"\n\n<{D}tool_calls>")


def test_special_tokens_dropped_but_markup_kept():
    s = spec(drop=("<｜end▁of▁sentence｜>", "<｜User｜>", D))  # a tokenizer where ｜DSML｜ is special
    reasoning, content, calls, _ = parse(DEEPSEEK_EXAMPLE + "<｜User｜>", s)
    assert calls == [("get_weather", '{"location": "Beijing", "unit": "celsius"}')] and content == ""


@pytest.mark.parametrize("dialect", ["deepseek_v3", "deepseek_v31"])
def test_v3_formats(dialect):
    args = {"city": "北京", "days": [1, 2]}
    body = (
        f"function<｜tool▁sep｜>get_weather\n```json\n{json.dumps(args)}\n```"
        if dialect == "deepseek_v3"
        else f"get_weather<｜tool▁sep｜>{json.dumps(args, ensure_ascii=False)}"
    )
    text = f"<think>hm</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    s = spec(thinking=False, reasoning="deepseek_r1", tool_parser=dialect)
    reasoning, content, calls, failures = parse(text, s)
    assert (reasoning, content, failures) == ("hm", "Let me check.", [])
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", args)]
    rng = random.Random(3)
    for _ in range(30):
        assert parse(text, s, random_pieces(rng, text)) == (reasoning, content, calls, failures)
    assert set(DIALECTS) == {"deepseek_v4", "deepseek_v32", "deepseek_v31", "deepseek_v3"}


def test_scanner_never_decides_inside_a_possible_marker():
    sc = MarkerScanner(["</｜DSML｜invoke>", "｜DSML｜", "<think>"])
    assert sc.feed("a</｜DSML｜inv") == [(False, "a")]  # ｜DSML｜ is complete, but inside a longer one
    assert sc.feed("oke>b<") == [(True, "</｜DSML｜invoke>"), (False, "b")]
    assert sc.finish() == [(False, "<")]


def test_defaults_and_tool_names():
    assert default_parsers("deepseek_v4", None) == ("deepseek_v4", "deepseek_v4")
    assert default_parsers("deepseek_v3", "{{'<｜tool▁sep｜>' + name + '\\n```json\\n'}}") == (
        "deepseek_r1",
        "deepseek_v3",
    )
    assert default_parsers("deepseek_v3", "{{'<｜tool▁sep｜>' + arguments}}") == ("deepseek_r1", "deepseek_v31")
    assert default_parsers("llama", None) == (None, None)
    assert tool_names([{"type": "function", "function": {"name": "f"}}, {"type": "x"}]) == frozenset({"f"})


SOUP = [
    "<think>", "</think>", f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="search">',
    f'<{D}invoke name="nope">', f"</{D}invoke>", f'<{D}parameter name="q" string="true">',
    f'<{D}parameter name="n" string="false">', f"</{D}parameter>", "<｜end▁of▁sentence｜>", D, "\n\n", "\n",
    "[1]", "{", "text", "北京", "e\u0301", "<", "｜",
]  # fmt: skip


@pytest.mark.parametrize("thinking", [True, False])
def test_any_markup_soup_parses_the_same_in_any_pieces(thinking):
    """Malformed or not: never an exception, and the pieces never change the outcome."""
    rng = random.Random(2800 + thinking)
    s = spec(thinking=thinking, drop=("<｜end▁of▁sentence｜>",))
    for _ in range(400):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 30)))
        whole = parse(text, s)
        assert "<think>" not in whole[1] and "</think>" not in whole[1]
        for _ in range(3):
            assert parse(text, s, random_pieces(rng, text)) == whole, text


def test_json_nested_past_the_decoder_is_bad_json():
    deep = f'<{D}tool_calls>\n<{D}invoke name="search">\n<{D}parameter name="n" string="false">{"[" * 100000}'
    text = f"{deep}</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>"
    assert parse(text, spec(thinking=False)) == ("", "", [("search", '{"n": ', "bad_json")], ["bad_json"])
