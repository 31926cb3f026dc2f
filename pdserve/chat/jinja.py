"""Chat templates in Jinja, rendered as transformers renders them: a sandbox with trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`, `{% generation %}`, and
a `namespace()` without underscore attributes. `template_variables` lists what a template reads, so
a request's chat_template_kwargs that no template reads are refused rather than ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' named special tokens, passed to chat templates under these names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching into internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def plain(value: Any) -> Any:
    """Plain JSON-like data for the sandbox: pydantic models dumped, containers copied."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def alias_reasoning(chat: list[dict]) -> list[dict]:
    # transformers exposes a message's reasoning under both names templates read.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def tag_final_message(chat: list[dict], field: str, template: str) -> str:
    """Mark the end of the final message's `field` so rendering can be cut right after it."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message is set but the final message has no {field!r}")
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads {field!r}")
    if isinstance(final, list):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message: the final message has no text block to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template dropped part of the final message")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names a template reads that it does not set itself."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
