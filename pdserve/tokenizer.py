"""Tokenizer: HF `tokenizers` on a checkpoint folder, without transformers.

Reads tokenizer.json, tokenizer_config.json (special tokens, chat template) and, where
present, special_tokens_map.json and chat_template.jinja. Behaves as transformers 5's
`AutoTokenizer` does for the same folder:

- `encode(text)` adds what tokenizer.json's post-processor adds (DeepSeek's adds BOS).
  A tokenizer.json without a post-processor gets BOS/EOS from tokenizer_config's
  `add_bos_token` / `add_eos_token`.
- `decode` is the backend's decode; no "clean up tokenization spaces" (transformers 5
  skips it for BPE tokenizers, which is what DeepSeek ships).
- `apply_chat_template` renders the Jinja template in a sandbox with trim_blocks and
  lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the named
  special tokens as variables; tokenize=True encodes without adding special tokens
  (the template writes BOS itself).

`IncrementalDetokenizer` turns a stream of token ids into text deltas that never end
inside a multi-byte UTF-8 character.
"""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

# transformers' named special tokens, passed to chat templates under these names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode writes for incomplete bytes


class Tokenizer:
    """The tokenizer of one checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: pdserve needs a Hugging Face fast tokenizer file "
                "(or run with skip_tokenizer_init=True and pass token ids)"
            )
        self._backend = _Backend.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        special = {**_read_json(folder / "special_tokens_map.json"), **config}
        self.special_tokens: dict[str, str] = {
            name: _token_text(special[name]) for name in SPECIAL_TOKEN_NAMES if _token_text(special.get(name))
        }
        self._add_missing_special_tokens(config)
        if self._backend.post_processor is None:
            self._set_post_processor(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        self.chat_template: str | dict[str, str] | None = _load_chat_template(folder, config)
        self.model_max_length: int | None = config.get("model_max_length")
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids past the vocabulary (padded model vocab) decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template; token ids if `tokenize` (no second BOS)."""
        template = self._pick_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot be used together")
        chat = _alias_reasoning(_plain([{k: v for k, v in m.items() if v is not None} for m in _plain(messages)]))
        final_text = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, field, template)
        variables = {**self.special_tokens, **_plain(kwargs)}
        text = _compile(template).render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if final_text is not None:
            text = _cut_at_tag(text, final_text)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _pick_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this tokenizer has several chat templates and none named 'default': {sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
        return templates

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def _add_missing_special_tokens(self, config: dict) -> None:
        # As transformers does: named and extra special tokens absent from the vocab are added.
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):
            extra = list(extra.values())
        wanted = list(self.special_tokens.values()) + [_token_text(t) for t in extra]
        missing = [t for t in dict.fromkeys(wanted) if t and self._backend.token_to_id(t) is None]
        if missing:
            self._backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        ids = [(t, self._backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


class IncrementalDetokenizer:
    """Per-sequence streaming decode: `push` returns only text made of complete characters.

    Decodes a short window of recent tokens (prefix window + new tokens) and emits the
    part past the prefix. A window whose text ends in U+FFFD holds an incomplete UTF-8
    character, so nothing is emitted until a later token completes it (or `flush`).
    Decoding from a prefix rather than from the new token alone keeps the spacing that
    tokenizers with word-start markers (Metaspace) add only between tokens.
    """

    PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context for the first output

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids or [])
        self.read_offset = len(self.token_ids)  # tokens before this are already emitted
        self.prefix_offset = max(self.read_offset - self.PROMPT_CONTEXT, 0)  # start of the decode window
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly complete text (may be "")."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    # As transformers: a chat_template.jinja file wins over tokenizer_config's entry.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return {t["name"]: t["template"] for t in template}
    return template


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
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Plain JSON-like data for the sandbox: pydantic models dumped, containers copied."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # transformers exposes a message's reasoning under both names templates read.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict], field: str, template: str) -> str:
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


def _cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template dropped part of the final message")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
