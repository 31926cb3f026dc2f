"""A StructuredOutputsParams compiled against a tokenizer with llguidance: the grammar text, the
library's tokenizer view, and a compiled matcher per spec (LRU) that each request copies. No torch.

JSON is laid out one way (no free whitespace, json.dumps' ", " and ": "): a model cannot spend its
tokens on whitespace, and a schema that bounds its strings and arrays bounds the answer's length.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance as llg

from pdserve.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled specs kept per tokenizer view

_lock = threading.Lock()
_views: weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCompiler]] = weakref.WeakKeyDictionary()


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for the spec (not yet checked); ValueError for a schema that is not JSON."""
    kind = params.kind
    if kind == "json_schema":
        schema = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured outputs: a JSON schema must be an object")
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llg.grammar_from("grammar", params.grammar)  # Lark or GBNF (llama.cpp's EBNF)


def spec_key(params: StructuredOutputsParams) -> str:
    """What identifies a compiled grammar: the spec without start_after_token_id."""
    value = getattr(params, params.kind)
    return params.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


class CompiledGrammar:
    """One spec compiled for one tokenizer view; `matcher()` is a fresh copy at the start state."""

    def __init__(self, template: llg.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> llg.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """llguidance's view of a tokenizer (vocab_size: the model's, padded past the tokenizer's;
    eos_token_ids: what ends a request) and the specs compiled for it, most recent kept."""

    def __init__(self, backend_json: str, vocab_size: int | None, eos_token_ids: list[int]) -> None:
        self.tokenizer = llg.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = self.tokenizer.vocab_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The spec's compiled grammar (cached); ValueError with llguidance's message if it rejects it."""
        key = spec_key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        matcher = llg.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: {params.kind} rejected: {matcher.get_error().strip()}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def compiler_for(
    tokenizer: Any, vocab_size: int | None = None, eos_token_ids: list[int] | None = None
) -> GrammarCompiler:
    """The GrammarCompiler of a pdserve Tokenizer (one per tokenizer, vocab size and EOS set)."""
    eos = sorted(set(eos_token_ids)) if eos_token_ids is not None else [tokenizer.eos_token_id]
    eos = [e for e in eos if e is not None]
    key = (vocab_size, tuple(eos))
    with _lock:
        per_tok = _views.setdefault(tokenizer, {})
        comp = per_tok.get(key)
        if comp is None:
            # the backend as the Tokenizer set it up (added special tokens included)
            comp = per_tok[key] = GrammarCompiler(tokenizer.backend.to_str(), vocab_size, eos)
        return comp


def check(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """ValueError naming the problem when llguidance rejects the spec (a bad schema, regex or
    grammar); the router's 400. Compiles (and caches) the spec against the tokenizer."""
    compiler_for(tokenizer).compile(params)
