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

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

from pdserve.chat import dsv4, dsv4_revision
from pdserve.chat.jinja import (
    SPECIAL_TOKEN_NAMES,
    alias_reasoning,
    compile_template,
    cut_at_tag,
    plain,
    tag_final_message,
    template_variables,
)

DSV4_VARIABLES = frozenset({"thinking", "enable_thinking", "reasoning_effort", "response_format"})
REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode writes for incomplete bytes


class Tokenizer:
    """The tokenizer of one checkpoint folder."""

    def __init__(self, model_dir: str | Path, encoder_revision: str = "auto"):
        """`encoder_revision`: the built-in DeepSeek-V4 encoder's (chat/dsv4_revision.py; auto: the
        checkpoint's); a revision named for a checkpoint without that encoder is a ValueError."""
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
        self.model_type: str | None = _read_json(folder / "config.json").get("model_type")
        self.model_max_length: int | None = config.get("model_max_length")
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")
        self.encoder_revision: str | None = None  # the built-in V4 encoder's revision (None: not that encoder)
        if self.builtin_chat_encoder:
            self.encoder_revision = dsv4_revision.choose(encoder_revision, folder)
        elif encoder_revision != "auto":
            raise ValueError(
                f"chat encoder revision {encoder_revision!r}: {folder} has no built-in DeepSeek-V4 encoder "
                "(the revision is for a deepseek_v4 checkpoint without a chat template)"
            )

    @property
    def backend(self) -> _Backend:
        """The `tokenizers` Tokenizer as set up here (added special tokens, post-processor): what a
        library that reads tokenizer.json (llguidance) is given, as `backend.to_str()`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def special_id_set(self) -> frozenset[int]:
        return frozenset(self.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids past the vocabulary (padded model vocab) decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def builtin_chat_encoder(self) -> bool:
        """DeepSeek-V4 without a Jinja template: the built-in encoder (chat/dsv4.py) renders chats."""
        return self.chat_template is None and self.model_type == "deepseek_v4"

    def chat_template_variables(self, tools: list[dict] | None = None) -> frozenset[str]:
        """The variables the chat template reads (chat_template_kwargs it can use)."""
        if self.builtin_chat_encoder:
            return DSV4_VARIABLES
        return template_variables(self._pick_template(None, tools))

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
        """Render `messages` with the chat template; token ids if `tokenize` (no second BOS).
        DeepSeek-V4 without a template: the built-in encoder, with kwargs thinking / enable_thinking,
        reasoning_effort and response_format (rendered into the system message, as tools are)."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot be used together")
        if self.builtin_chat_encoder and chat_template is None:
            if continue_final_message or documents:
                raise ValueError("the DeepSeek-V4 encoder takes no continue_final_message or documents")
            text = _encode_dsv4(
                plain(messages), plain(tools), add_generation_prompt, plain(kwargs), self.encoder_revision
            )
            return self.encode(text, add_special_tokens=False) if tokenize else text
        template = self._pick_template(chat_template, tools)
        chat = alias_reasoning(plain([{k: v for k, v in m.items() if v is not None} for m in plain(messages)]))
        final_text = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = tag_final_message(chat, field, template)
        variables = {**self.special_tokens, **plain(kwargs)}
        text = compile_template(template).render(
            messages=chat,
            tools=plain(tools),
            documents=plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if final_text is not None:
            text = cut_at_tag(text, final_text)
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

    A token's text is cut from the decode of the tokens since the last text came out, after those
    of that text (the prefix): decoding from a prefix rather than the new token alone keeps the
    spacing that tokenizers with word-start markers (Metaspace) add only between tokens, and the
    first output decodes after the prompt's last tokens. While the decode ends in U+FFFD (an
    incomplete UTF-8 character) nothing comes out until a later token completes it (or `flush`).
    Per token this decodes a few tokens, however long the output.

    tokenizers' DecodeStream (Rust, tokenizers >= 0.22) does it about twice as fast as Python
    (docs/benchmarking.md); the Python path (`_cut`) runs where it is missing, for a prefix whose
    text ends inside a character (DecodeStream would not keep it as a prefix), and for a token
    that DecodeStream refuses (its decode no longer starts with the prefix's: lossy bytes), until
    text comes out again.
    """

    PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context for the first output

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
        use_stream: bool = True,
    ):
        """use_stream: False runs the Python path alone (to compare the two)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = tokenizer.backend
        # ids that decode to nothing wherever they stand: left out, so a run of them (EOS under
        # ignore_eos) never widens the decode window
        self._silent = tokenizer.special_id_set if skip_special_tokens else frozenset()
        self._vocab = tokenizer.vocab_size
        self._prefix: list[int] = list(prompt_token_ids or [])[-self.PROMPT_CONTEXT :]  # tokens of the last text out
        self._held: list[int] = []  # tokens since, their text not out yet
        self._use_stream = use_stream and _decode_stream() is not None
        self._stream = self._new_stream()

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly complete text (may be "")."""
        if token_id in self._silent or token_id >= self._vocab:
            return ""
        self._held.append(token_id)
        text = None
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # a decode that does not continue the prefix's text: cut it in Python
                self._stream = None
        if self._stream is None:
            text = self._cut(hold=True)
        if not text:
            return ""
        self._prefix, self._held = self._held, []
        if self._stream is None:
            self._stream = self._new_stream()
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        text = self._cut(hold=False)
        self._prefix, self._held, self._stream = [], [], None  # a sequence's end: nothing comes next
        return text

    def _cut(self, hold: bool) -> str:
        """The held tokens' text: the decode of prefix + held past the prefix's text ("" while it
        is not longer or, with hold, ends inside a character)."""
        prefix = self._decode(self._prefix)
        whole = self._decode(self._prefix + self._held)
        if hold and (len(whole) <= len(prefix) or whole.endswith(REPLACEMENT_CHAR)):
            return ""
        return whole[len(prefix) :]

    def _new_stream(self) -> Any:
        """A DecodeStream continuing after self._prefix, or None for the Python path."""
        if not self._use_stream or self._decode(self._prefix).endswith(REPLACEMENT_CHAR):
            return None
        return _decode_stream()(ids=self._prefix, skip_special_tokens=self.skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@functools.cache
def _decode_stream() -> type | None:
    """tokenizers' DecodeStream if it takes a prefix (`ids`, tokenizers >= 0.22), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=False)
    except (ImportError, TypeError):
        return None
    return DecodeStream


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


def _encode_dsv4(
    messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, kwargs: dict, revision: str
) -> str:
    """OpenAI-style messages to the reference encoder's input: request-level tools and
    response_format on the first system message (one made at the start when there is none),
    developer messages as system ones, reasoning under reasoning_content, text parts joined."""
    unknown = sorted(set(kwargs) - DSV4_VARIABLES)
    if unknown:
        raise ValueError(f"the DeepSeek-V4 encoder reads no {', '.join(unknown)}")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "developer":  # OpenAI's newer name for the system role
            m["role"] = "system"
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"the DeepSeek-V4 encoder takes roles system, user, assistant, tool; not {m.get('role')!r}"
            )
        if isinstance(m.get("content"), list) and m["role"] != "tool":
            m["content"] = "".join(p.get("text", "") for p in m["content"] if p.get("type") == "text")
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        chat.append(m)
    extras = {"tools": tools, "response_format": kwargs.get("response_format")}
    if any(extras.values()):
        at = next((i for i, m in enumerate(chat) if m["role"] == "system"), None)
        if at is None:
            chat.insert(0, {"role": "system", "content": ""})
            at = 0
        chat[at].update({k: v for k, v in extras.items() if v})
    return dsv4.encode(
        chat,
        thinking=bool(thinking),
        reasoning_effort=kwargs.get("reasoning_effort"),
        add_generation_prompt=add_generation_prompt,
        revision=revision,
    )
