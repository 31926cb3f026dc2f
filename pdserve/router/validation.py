"""From an OpenAI request to what the workers run: prompt token ids and SamplingParams per choice.

The checks that need the model live here (the schema's own checks are in openai_protocol.py):
model name (404), options pdserve does not implement (400), prompt and completion length against
max_model_len (400, code context_length_exceeded), token ids against the vocabulary (400), the
chat template rendering (400). Constraints become SamplingParams.structured_outputs: the structured
outputs fields (both endpoints), and tool_choice required / a named function as the grammar of the
model's tool-call block (pdserve/chat/tool_grammar.py, tool_grammar_v3.py).

Tokenizing holds the GIL (a multi-MB prompt stalls the router for seconds), so text that cannot
fit the context whatever it tokenizes to is refused before it is tokenized: no token spans more
than `max_token_chars` characters, and normalizers shrink text by less than NORMALIZER_SLACK.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
from pydantic import ValidationError

from pdserve import structured
from pdserve.chat import controls
from pdserve.chat.dsv4 import DSML, END_THINK, THINK
from pdserve.chat.tool_grammar import ToolGrammarError, dsml_tool_grammar
from pdserve.chat.tool_grammar_v3 import MARKERS as V3_MARKERS
from pdserve.chat.tool_grammar_v3 import v3_tool_grammar
from pdserve.router.chat_fields import NamedToolChoice
from pdserve.router.openai_protocol import INT64_MAX, ChatCompletionRequest, CompletionRequest, _Request
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.structured.compiler import JSON_OPTIONS
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError

FORCED_FORMATS = ("deepseek_v4", "deepseek_v32", "deepseek_v31", "deepseek_v3")  # forced calls' grammars
NORMALIZER_SLACK = 4  # Unicode composition merges at most 3 characters into 1


@dataclass
class Prepared:
    """One choice per prompt: a completions batch has several, chat has one."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    logprobs: int | None  # top-N alternatives requested, None for no logprobs
    n: int = 1  # choices a prompt (engine/forks.py: one prefill, n sequences)
    thinking: bool = False  # chat: the prompt ends in <think> (the output starts with reasoning)
    tools: list[dict] | None = None  # chat: the request's tools (OpenAI form)
    tool_choice: str = "auto"  # chat: "auto", "none", or "required" (required or a named function: a grammar)


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer, served_model_name: str, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.chat_defaults: dict[str, Any] = {}  # --default-chat-template-kwargs
        self.tool_parser: str | None = None  # the router's tool-call parser: the format forced calls take
        self.served_model_name = served_model_name
        self.vocab_size = vocab_size
        self.max_token_chars = max(len(tokenizer.id_to_token(i) or "") for i in range(len(tokenizer))) or 1

    def completion(self, req: CompletionRequest, max_model_len: int) -> Prepared:
        self._common(req)
        for flag, bad in (("echo", req.echo), ("suffix", req.suffix is not None)):
            if bad:
                raise OpenAIError(400, f"{flag} is not supported by pdserve", param=flag, code="unsupported_parameter")
        if req.best_of is not None and req.best_of < req.n:
            raise OpenAIError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
        if req.best_of is not None and req.best_of > req.n and req.stream:
            raise OpenAIError(400, "best_of > n cannot be streamed: the best are known at the end", param="best_of")
        prompts = [self._prompt_ids(p, max_model_len) for p in req.prompts()]
        params = [self._params(req, len(ids), max_model_len, req.max_tokens, req.logprobs) for ids in prompts]
        spec = structured_outputs(req)
        if spec is not None:
            constraint = self._checked(spec, thinking=False)
            for p in params:
                p.structured_outputs = constraint
        return Prepared(prompts, params, req.logprobs, n=req.n)

    def set_chat_defaults(self, defaults: dict[str, Any]) -> None:
        """The server's default chat_template_kwargs; ValueError (at startup) if the template cannot use them."""
        try:
            variables = self.tokenizer.chat_template_variables()
        except ValueError:  # no chat template
            variables = frozenset()
        controls.resolve(variables=variables, v4_revision=self.tokenizer.encoder_revision, defaults=defaults)
        self.chat_defaults = dict(defaults)

    def chat_prompt(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        thinking: str | None = None,
        reasoning_effort: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of a chat, as the model's template or encoder renders it (400 if it cannot)."""
        tok = self.tokenizer
        try:
            variables = tok.chat_template_variables(tools)
            kwargs = controls.resolve(
                variables=variables,
                v4_revision=tok.encoder_revision,
                thinking=thinking,
                reasoning_effort=reasoning_effort,
                kwargs=template_kwargs,
                defaults=self.chat_defaults,
            )
        except controls.ControlError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        except ValueError as e:  # no template at all
            raise OpenAIError(400, str(e), param="messages") from None
        if tools and "tools" not in variables and not tok.builtin_chat_encoder:
            raise OpenAIError(400, "this model's chat template does not render tools", param="tools")
        if response_format is not None and "response_format" in variables:
            kwargs["response_format"] = response_format
        try:
            return tok.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                tools=tools,
                **kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise OpenAIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None

    def chat(self, req: ChatCompletionRequest, max_model_len: int) -> Prepared:
        self._common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tool_choice, forced = _tool_choice(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        messages = [m.for_template() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in messages) + len(json.dumps(tools or []))
        self._fits_untokenized(chars, max_model_len, "messages")
        fmt = req.response_format
        ids = self.chat_prompt(
            messages,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            thinking=req.thinking.type if req.thinking is not None else None,
            reasoning_effort=req.reasoning_effort,
            template_kwargs=req.chat_template_kwargs,
            response_format=fmt.as_sent() if fmt and fmt.type != "text" else None,
        )
        if not ids:
            raise OpenAIError(400, "the messages render to an empty prompt", param="messages")
        thinking = self._ends_thinking(ids)
        params = self._params(req, len(ids), max_model_len, req.token_limit(), logprobs)
        spec = structured_outputs(req)
        if forced is not None and spec is not None:
            raise OpenAIError(
                400,
                f"tool_choice {forced or 'required'!r} and {spec['param']} each ask for a constraint; send one",
                param=spec["param"],
            )
        if forced is not None:
            params.structured_outputs = self._tool_calls(tools, forced or None, req.parallel_tool_calls, thinking)
        elif spec is not None:
            params.structured_outputs = self._checked(spec, thinking)
        return Prepared(
            [list(ids)], [params], logprobs, n=req.n, thinking=thinking, tools=tools, tool_choice=tool_choice
        )

    def _tool_calls(
        self, tools: list[dict], name: str | None, parallel: bool | None, thinking: bool
    ) -> StructuredOutputsParams:
        """The grammar of forced tool calls (tool_choice required, or `name`): one or more calls
        in the tool-call parser's format, each tool's arguments as its schema says."""
        fmt = self.tool_parser
        if fmt not in FORCED_FORMATS:
            raise OpenAIError(
                400,
                f"{'a named tool_choice' if name else repr('required') + ' tool_choice'} needs a tool-call "
                f"parser ({', '.join(FORCED_FORMATS)}); this server's is {fmt or 'none'}",
                param="tool_choice",
                code="unsupported_parameter",
            )
        ids = {t: self.tokenizer.token_to_id(t) for t in (DSML, END_THINK, *V3_MARKERS)}
        if fmt in ("deepseek_v4", "deepseek_v32") and ids[DSML] is None:
            raise OpenAIError(400, f"tool_choice: the tokenizer has no {DSML} token", param="tool_choice")
        kw = dict(name=name, single=parallel is False, thinking=thinking, json_layout=JSON_OPTIONS)
        try:
            if fmt in ("deepseek_v3", "deepseek_v31"):
                grammar = v3_tool_grammar(tools, dialect=fmt, ids=ids, **kw)
            else:
                block = "function_calls" if fmt == "deepseek_v32" else "tool_calls"
                grammar = dsml_tool_grammar(tools, ids=ids, block=block, **kw)
            params = StructuredOutputsParams(grammar=grammar)
            structured.check(params, self.tokenizer)
        except ToolGrammarError as e:
            raise OpenAIError(400, str(e), param="tools") from None
        except ValueError as e:  # a parameter schema the grammar library rejects
            raise OpenAIError(400, f"tools: {e}", param="tools") from None
        return params

    def _ends_thinking(self, ids: list[int]) -> bool:
        """The prompt opens the model's reasoning: it ends with <think> (and perhaps a newline)."""
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False)  # "<think>\n": 8 characters at most
        return tail.rstrip("\n").endswith(THINK)

    def _checked(self, spec: dict[str, Any], thinking: bool) -> StructuredOutputsParams:
        if thinking:
            end = self.tokenizer.token_to_id(END_THINK)
            if end is None:
                raise OpenAIError(
                    400, f"structured outputs in thinking mode need a {END_THINK} token", param="thinking"
                )
            spec["start_after_token_id"] = end
        param = spec.pop("param")
        try:
            params = StructuredOutputsParams(**spec)
            structured.check(params, self.tokenizer)
        except ValueError as e:
            raise OpenAIError(400, f"{param}: {e}", param=param) from None
        return params

    # -- shared --
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _common(self, req: _Request) -> None:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        self._logit_bias(req)
        if req.stop_token_ids and any(not 0 <= t < self.vocab_size for t in req.stop_token_ids):
            raise OpenAIError(400, f"stop_token_ids must lie in [0, {self.vocab_size})", param="stop_token_ids")

    def _logit_bias(self, req: _Request) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids (as strings) of this vocabulary -> a bias in [-100, 100]."""
        if not req.logit_bias:
            return None
        bias = {}
        for key, value in req.logit_bias.items():
            if not key.strip().isdecimal() or not 0 <= int(key) < self.vocab_size:
                raise OpenAIError(
                    400, f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}", param="logit_bias"
                )
            if not -100.0 <= value <= 100.0:
                raise OpenAIError(400, f"logit_bias values must lie in [-100, 100], got {value}", param="logit_bias")
            bias[int(key)] = float(value)
        return bias

    def _fits_untokenized(self, chars: int, max_model_len: int, param: str) -> None:
        """Refuse, without tokenizing, text too long for the context whatever its tokens."""
        if chars > NORMALIZER_SLACK * self.max_token_chars * max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{chars} characters, more than that many tokens can hold. Please shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def _prompt_ids(self, prompt: str | list[int], max_model_len: int) -> list[int]:
        if isinstance(prompt, str):
            self._fits_untokenized(len(prompt), max_model_len, "prompt")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise OpenAIError(400, f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
        return list(ids)

    def _params(
        self, req: _Request, prompt_len: int, max_model_len: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        room = max_model_len - prompt_len
        if room < 1:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or the completion length.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=None if req.seed is None else req.seed & INT64_MAX,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                max_tokens=room if max_tokens is None else max_tokens,
                min_tokens=req.min_tokens,
                stop=list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                logit_bias=self._logit_bias(req),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                n=req.n,
                best_of=getattr(req, "best_of", None),
            )
        except ValidationError as e:  # rules across fields, e.g. min_tokens <= max_tokens
            first = e.errors()[0]
            msg = first["msg"].removeprefix("Value error, ")
            param = ".".join(str(p) for p in first["loc"]) or next(
                (f for f in ("min_tokens", "max_tokens") if f in msg), None
            )
            raise OpenAIError(400, f"{param + ': ' if first['loc'] else ''}{msg}", param=param) from None


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """(tool_choice as Prepared keeps it, what a grammar forces: "" for any tool, a function's
    name, None for nothing)."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
    if req.parallel_tool_calls is False and choice in (None, "auto"):
        raise OpenAIError(
            400,
            "parallel_tool_calls: false is honoured with tool_choice 'required', a named function or 'none', "
            "not with 'auto'",
            param="parallel_tool_calls",
            code="unsupported_parameter",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if all(t.function.name != name for t in req.tools):
            raise OpenAIError(
                400, f"tool_choice names the function {name!r}, which is not among the tools", param="tool_choice"
            )
        return "required", name
    if choice == "required":
        return "required", ""
    return choice or "auto", None


def structured_outputs(req: _Request) -> dict[str, Any] | None:
    """StructuredOutputsParams fields (and `param`, the field they came from) of the one request
    field that asks for a constraint; 400 if several do."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        asked.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        asked.append(("structured_outputs", so))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(req, field) is not None:
            asked.append((field, {key: getattr(req, field)}))
    if len(asked) > 1:
        names = " and ".join(a[0] for a in asked)
        raise OpenAIError(400, f"{names} each ask for a constraint; send one", param=asked[1][0])
    return {**asked[0][1], "param": asked[0][0]} if asked else None
