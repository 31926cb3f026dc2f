"""JSON values that hold no tool-call markup (pdserve/chat/markup_free.py): the regexes against a
brute-force oracle (`text in s`) on seeded random strings over the marker's own characters, and
rewritten schemas through llguidance (the library forced calls use) on values with the markup in
strings, keys and nested values, and on the same values without it."""

from __future__ import annotations

import random
import re

import llguidance as llg
import pytest

from pdserve.chat.markup_free import MarkupSchemaError, _Avoid, avoiding, schema_without
from pdserve.structured import compiler_for
from pdserve.structured.compiler import JSON_OPTIONS
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from tests.helpers.kernels import seed_of

TEXTS = ["｜DSML｜", "<｜tool▁", "abca", "ab", "aba"]


def strings(rng: random.Random, text: str, n: int) -> list[str]:
    alpha = sorted(set(text)) + ["z", "\n"]
    return ["".join(rng.choice(alpha) for _ in range(rng.randint(0, 12))) for _ in range(n)]


@pytest.mark.parametrize("text", TEXTS)
def test_the_regexes_against_brute_force(text):
    rng = random.Random(seed_of("markup_free", text))
    a = _Avoid(text)
    every = re.compile(f"^{avoiding(text)}$", re.S)
    for s in strings(rng, text, 20000):
        assert bool(every.match(s)) == (text not in s), s
    for k in range(len(text)):  # from a state: what may follow the first k characters
        after = re.compile(f"^{a.after(k)}$", re.S)
        for s in strings(rng, text, 4000):
            assert bool(after.match(s)) == (text not in text[:k] + s), (k, s)
    for words in (["za", "z", text[0] + "z", text[:-1]], [text[1:]], ["zz" + text[:-1], ""]):
        others = re.compile(f"^{a.except_words(words)}$", re.S)
        for s in strings(rng, text, 8000) + [w + t for w in words for t in ("", "z", text[0])]:
            assert bool(others.match(s)) == (text not in s and s not in words), (words, s)


def test_texts_it_cannot_spell():
    with pytest.raises(ValueError):
        avoiding("abab")  # the first character inside the text


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(make_tiny_model(tmp_path_factory.mktemp("markup_free") / "tiny", arch="deepseek_v4", seed=0))


def accepts(tok: Tokenizer, schema: dict, text: str) -> bool:
    g = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    m = llg.LLMatcher(compiler_for(tok).tokenizer, g, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


D = "｜DSML｜"
NODE = {"type": "object", "properties": {"s": {"type": "string"}, "c": {"$ref": "#/$defs/n"}}}
CASES = [  # (schema, values it takes, values with the markup it must refuse)
    ({}, ['1', '"a｜DSM"', '{"a": ["b"]}'], [f'"a{D}b"', f'{{"{D}": 1}}', f'[{{"a": "x{D}"}}]']),
    ({"type": "string", "pattern": "^a"}, ['"ab"'], [f'"a{D}"']),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     ['{"a": "x"}', '{"a": "x", "b": [2]}'], [f'{{"a": "{D}"}}', f'{{"a": "x", "b": "</{D}parameter>"}}']),
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     ['{"n": 1, "na": "x"}'], [f'{{"n": 1, "k{D}": "x"}}', f'{{"n": 1, "k": "{D}"}}']),
    ({"type": "array", "items": {"type": "string", "maxLength": 30}}, ['["a", "b"]'], [f'["</{D}invoke>"]']),
    ({"type": ["string", "null"]}, ['null', '"a"'], [f'"{D}"']),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, ['1', '"a"'], [f'"{D}"']),
    ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"},
     ['{"s": "a", "c": {"s": "b", "x": 1}}'], [f'{{"c": {{"s": "{D}"}}}}', f'{{"c": {{"x": "{D}"}}}}']),
    ({"type": "string", "format": "date"}, ['"2020-01-02"'], []),
]  # fmt: skip


@pytest.mark.parametrize("schema, good, bad", CASES)
def test_rewritten_schemas(tok, schema, good, bad):
    free = schema_without(schema, D)
    for value in good:
        assert accepts(tok, schema, value) and accepts(tok, free, value), value
    for value in bad:
        assert accepts(tok, schema, value) and not accepts(tok, free, value), value


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
        ({"enum": ["a", f"b{D}"]}, "enum"),
        ({"type": "object", "properties": {f"k{D}": {}}}, "property name"),
    ],
)
def test_schemas_it_cannot_rewrite(schema, words):
    with pytest.raises(MarkupSchemaError, match=words):
        schema_without(schema, D)
