"""pdserve's DeepSeek-V4 encoder against DeepSeek's reference encoder (tests/fixtures/dsv4_encoding.json:
the reference's own test inputs and pdserve's cases, expected prompts written by the reference; the
fixture's note says which file and commit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.chat import dsv4

FIXTURE = json.loads((Path(__file__).parent.parent / "fixtures" / "dsv4_encoding.json").read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]


def test_fixture_covers_each_mode_and_effort():
    seen = {(c["thinking"], c["reasoning_effort"]) for c in CASES}
    assert seen == {(False, None), (True, None), (True, "high"), (True, "max")}
    assert sum(c["name"].startswith("reference_") for c in CASES) == 4


@pytest.mark.parametrize("case", CASES, ids=[f"{c['name']}-{c['thinking']}-{c['reasoning_effort']}" for c in CASES])
def test_encoder_matches_the_reference(case):
    got = dsv4.encode(case["messages"], thinking=case["thinking"], reasoning_effort=case["reasoning_effort"])
    assert got == case["expected"]


def test_without_generation_prompt_the_prompt_stops_after_the_last_turn():
    msgs = [{"role": "user", "content": "hi"}]
    assert dsv4.encode(msgs, thinking=True) == dsv4.BOS + dsv4.USER + "hi" + dsv4.ASSISTANT + dsv4.THINK
    assert dsv4.encode(msgs, thinking=True, add_generation_prompt=False) == dsv4.BOS + dsv4.USER + "hi"


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="reasoning_effort"):
        dsv4.encode([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="extreme")
    with pytest.raises(ValueError, match="role"):
        dsv4.encode([{"role": "robot", "content": "x"}], thinking=False)
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    with pytest.raises(ValueError, match="JSON object"):
        dsv4.encode([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}], thinking=False)
