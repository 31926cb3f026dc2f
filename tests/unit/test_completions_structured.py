"""/v1/completions takes structured outputs as vLLM does (`structured_outputs`, `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, `response_format`): the router maps each onto
SamplingParams.structured_outputs for every prompt of the batch, the same way chat completions do;
two constraints at once, or a spec the grammar library rejects, is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from pdserve.router.openai_protocol import CompletionRequest
from pdserve.router.validation import RequestValidator
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError

pytestmark = pytest.mark.timeout(120)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def validator(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("completions_so") / "m", arch="deepseek_v3")
    return RequestValidator(Tokenizer(model), "tiny", json.load(open(model / "config.json"))["vocab_size"])


def prepare(validator: RequestValidator, **fields):
    return validator.completion(CompletionRequest.model_validate({"prompt": ["a", "b c"], **fields}), 4096)


@pytest.mark.parametrize(
    "fields, kind, value",
    [
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "[a-z]{2}"}, "regex", "[a-z]{2}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'start: "a" | "b"'}, "grammar", 'start: "a" | "b"'),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}, "json_schema", SCHEMA),
    ],
)  # fmt: skip
def test_each_field_constrains_every_prompt(validator, fields, kind, value):
    prep = prepare(validator, **fields)
    assert len(prep.params) == 2
    for p in prep.params:
        so = p.structured_outputs
        assert so.kind == kind and getattr(so, kind) == value and so.start_after_token_id is None


def test_no_field_no_constraint(validator):
    assert all(p.structured_outputs is None for p in prepare(validator, response_format={"type": "text"}).params)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"guided_json": {"type": "foo"}}, "guided_json", "foo"),
        ({"guided_grammar": "start: nope"}, "guided_grammar", "nope"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "send one"),
    ],
)
def test_refusals_name_the_field_and_the_problem(validator, fields, param, words):
    with pytest.raises(OpenAIError) as e:
        prepare(validator, **fields)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
