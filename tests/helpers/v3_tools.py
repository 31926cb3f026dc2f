"""Tiny DeepSeek-V3 checkpoints that take tools: the tiny V3 model's chat template renders none,
so these write their own chat templates (written here, in the layout of DeepSeek-V3's and
V3.1's: the tools described in the system prompt, assistant calls in each format, tool outputs)
and add the tool-call markers to the tokenizer as DeepSeek's tokenizer has them (one added,
non-special token each; V3.1 also has <think> and </think>), after the trained vocabulary and
inside the model's padded vocab_size, so the weights are the tiny model's own.

    deepseek_v3   <calls▁begin><call▁begin>function<sep>NAME\\n```json\\n{...}\\n```<call▁end>\\n...<calls▁end>
    deepseek_v31  <calls▁begin><call▁begin>NAME<sep>{...}<call▁end>...<calls▁end>; `thinking` opens <think>
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from pdserve.tiny_model import make_tiny_model

MARKERS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]  # fmt: skip
THINK_TAGS = ["<think>", "</think>"]

_HEAD = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + ('\n\n' if ns.system else '') + m['content'] %}"
    "{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% if tools %}{{ '\n\n' if ns.system else '' }}## Tools\nYou have access to the following tools:\n"
    "{% for t in tools %}\n### {{ t['function']['name'] }}\nDescription: {{ t['function']['description'] or '' }}"
    "\n\nParameters: {{ t['function']['parameters'] | tojson }}\n{% endfor %}"
)
_TAIL = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% if m['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{% for c in m['tool_calls'] %}{{ CALL_SEP if not loop.first else '' }}{{ '<｜tool▁call▁begin｜>' }}CALL{{ '<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{% elif m['role'] != 'system' %}{{ raise_exception('Unsupported role: ' + m['role']) }}"
    "{% endif %}{% endfor %}"
)
V3_TEMPLATE = (
    _HEAD + "\nTo call tools, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n"
    "ARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}"
    + _TAIL.replace("CALL_SEP", "'\n'").replace(
        "CALL",
        "{{ 'function<｜tool▁sep｜>' + c['function']['name'] + '\n```json\n' + c['function']['arguments'] + '\n```' }}",
    )
    + "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
V31_TEMPLATE = (
    _HEAD + "\nTo call tools, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}"
    + _TAIL.replace("CALL_SEP", "''").replace(
        "CALL", "{{ c['function']['name'] + '<｜tool▁sep｜>' + c['function']['arguments'] }}"
    )
    + "{% if add_generation_prompt %}{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{% endif %}"
)
TEMPLATES = {"deepseek_v3": V3_TEMPLATE, "deepseek_v31": V31_TEMPLATE}


def make_tiny_v3_tools(out_dir: str | Path, dialect: str, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 checkpoint whose chat template renders tools in `dialect`'s format."""
    out = make_tiny_model(out_dir, arch="deepseek_v3", seed=seed)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    added = MARKERS + (THINK_TAGS if dialect == "deepseek_v31" else [])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert tok.get_vocab_size() <= vocab, "the added markers must fit the model's padded vocabulary"
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[dialect]
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return out
