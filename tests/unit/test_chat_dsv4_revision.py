"""DeepSeek-V4's two encoder revisions: each one's reasoning-effort texts against the reference's
own words (written out here, from DeepSeek's encoding/encoding_dsv4.py as its original release and
V4-Flash-0731 ship it: REASONING_EFFORT_MAX, then REASONING_EFFORT_PROMPTS), the prompts around them
against the reference's outputs (tests/fixtures/dsv4_encoding.json, written by the original
revision, which 0731 changed only in those texts), OpenAI's effort names mapped per revision, and
which revision a checkpoint gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from pdserve.chat import dsv4, dsv4_revision
from pdserve.config import RouterConfig
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.validation import RequestValidator
from pdserve.serve import add_serve_args, config_from_args
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer

# The reference's texts, character for character (0731's "high" is the original's "max").
ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
BEYOND = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
BOS, TAIL = "<｜begin▁of▁sentence｜>", "<｜User｜>solve it<｜Assistant｜><think>"
SOLVE = [{"role": "user", "content": "solve it"}]
FIXTURE = json.loads((Path(__file__).parent.parent / "fixtures" / "dsv4_encoding.json").read_text(encoding="utf-8"))
THINKING = [c for c in FIXTURE["cases"] if c["thinking"]]
ORIGINAL_SRC = 'REASONING_EFFORT_MAX = (\n    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\\n"\n)\n'
V0731_SRC = 'REASONING_EFFORT_PROMPTS = {\n    "low": "",\n    "high": "...",\n    "max": "...",\n}\nDEFAULT_REASONING_EFFORT = "low"\n'


@pytest.mark.parametrize(
    "revision, effort, prefix",
    [
        ("original", None, ""),
        ("original", "high", ""),  # the original's "high" writes nothing
        ("original", "max", ABSOLUTE),
        ("0731", None, ""),  # DEFAULT_REASONING_EFFORT = "low"
        ("0731", "low", ""),
        ("0731", "high", ABSOLUTE),
        ("0731", "max", BEYOND),
    ],
)
def test_each_revision_writes_the_reference_text_after_bos(revision, effort, prefix):
    got = dsv4.encode(SOLVE, thinking=True, reasoning_effort=effort, revision=revision)
    assert got == BOS + prefix + TAIL
    chat = dsv4.encode(SOLVE, thinking=False, reasoning_effort=effort, revision=revision)
    assert chat == BOS + "<｜User｜>solve it<｜Assistant｜></think>"  # no effort text in chat mode


@pytest.mark.parametrize("case", THINKING, ids=[f"{c['name']}-{c['reasoning_effort']}" for c in THINKING])
def test_0731_differs_from_the_reference_outputs_only_in_the_effort_text(case):
    """The fixture's prompts (the original encoder's): with no effort or "high" they start with no
    text, with "max" with ABSOLUTE; 0731 writes the same prompt behind its own text."""
    expected, msgs = case["expected"], case["messages"]
    head = ABSOLUTE if case["reasoning_effort"] == "max" else ""
    assert expected.startswith(BOS + head)
    body = expected[len(BOS + head) :]
    assert not body.startswith("Reasoning Effort")
    for effort, text in ((None, ""), ("low", ""), ("high", ABSOLUTE), ("max", BEYOND)):
        assert dsv4.encode(msgs, thinking=True, reasoning_effort=effort, revision="0731") == BOS + text + body


def test_efforts_and_revisions_outside_the_tables_are_value_errors():
    with pytest.raises(ValueError, match="reasoning_effort"):
        dsv4.encode(SOLVE, thinking=True, reasoning_effort="low", revision="original")
    with pytest.raises(ValueError, match="revision"):
        dsv4.encode(SOLVE, thinking=True, revision="0801")
    with pytest.raises(ValueError, match="auto, original, 0731"):
        dsv4_revision.choose("latest", "/nonexistent")


def _v4(folder: Path, encoder: str | None = None, config: dict | None = None) -> Path:
    make_tiny_model(folder, arch="deepseek_v4")
    if encoder is not None:
        (folder / "encoding").mkdir()
        (folder / "encoding" / "encoding_dsv4.py").write_text(encoder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def test_the_checkpoints_encoder_file_decides_then_its_name(tmp_path):
    assert dsv4_revision.detect(_v4(tmp_path / "a" / "my-v4", V0731_SRC))[0] == "0731"
    assert dsv4_revision.detect(_v4(tmp_path / "b" / "DeepSeek-V4-Flash-0731", ORIGINAL_SRC))[0] == "original"
    assert dsv4_revision.detect(_v4(tmp_path / "c" / "DeepSeek-V4-Flash-0731"))[0] == "0731"
    assert dsv4_revision.detect(_v4(tmp_path / "d" / "DeepSeek-V4-Flash"))[0] == "original"
    assert dsv4_revision.detect(_v4(tmp_path / "e" / "m", "# neither name"))[0] == "original"
    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4-Flash-0731" / "snapshots" / "0123abcd"
    assert dsv4_revision.detect(_v4(snapshot))[0] == "0731"
    named = _v4(tmp_path / "f" / "m", config={"_name_or_path": "deepseek-ai/DeepSeek-V4-Flash-0731"})
    assert dsv4_revision.detect(named)[0] == "0731"


def test_the_tokenizer_takes_the_detected_revision_unless_told(tmp_path):
    folder = _v4(tmp_path / "DeepSeek-V4-Flash-0731")
    assert Tokenizer(folder).encoder_revision == "0731"
    assert Tokenizer(folder, "original").encoder_revision == "original"
    tok = Tokenizer(folder, "0731")
    assert tok.apply_chat_template(SOLVE, thinking=True, reasoning_effort="max") == BOS + BEYOND + TAIL
    with pytest.raises(ValueError, match="latest"):
        Tokenizer(folder, "latest")
    v3 = make_tiny_model(tmp_path / "v3", arch="deepseek_v3")
    assert Tokenizer(v3).encoder_revision is None
    with pytest.raises(ValueError, match="no built-in DeepSeek-V4 encoder"):
        Tokenizer(v3, "0731")


# OpenAI's names -> each revision's text, as vLLM's deepseek_v4 tokenizer maps them
MAPPING = {
    "original": {"minimal": "", "low": "", "medium": "", "high": "", "xhigh": ABSOLUTE, "max": ABSOLUTE},
    "0731": {"minimal": "", "low": "", "medium": "", "high": ABSOLUTE, "xhigh": ABSOLUTE, "max": BEYOND},
}


@pytest.mark.parametrize("revision", list(MAPPING))
def test_request_efforts_map_onto_each_revision(tmp_path, revision):
    folder = _v4(tmp_path / "m")
    validator = RequestValidator(
        Tokenizer(folder, revision), "tiny", json.loads((folder / "config.json").read_text())["vocab_size"]
    )
    for effort, text in MAPPING[revision].items():
        prep = validator.chat(
            ChatCompletionRequest.model_validate({"messages": SOLVE, "reasoning_effort": effort}), 4096
        )
        assert validator.tokenizer.decode(prep.prompts[0], skip_special_tokens=False) == BOS + text + TAIL, effort


def test_the_router_flag_and_config(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = ["--role", "router", "--model", "m", "--colocated", "http://x:1"]
    assert config_from_args(p.parse_args(args)).router.chat_encoder_revision == "auto"
    cfg = config_from_args(p.parse_args([*args, "--chat-encoder-revision", "0731"]))
    assert cfg.router.chat_encoder_revision == "0731"
    with pytest.raises(ValueError, match="chat_encoder_revision"):
        config_from_args(p.parse_args([*args, "--chat-encoder-revision", "latest"]))
    assert get_args(RouterConfig.model_fields["chat_encoder_revision"].annotation) == dsv4_revision.SETTINGS
