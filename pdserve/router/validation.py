"""From an OpenAI request to what the workers run: prompt token ids and SamplingParams per choice.

The checks that need the model live here (the schema's own checks are in openai_protocol.py):
model name (404), options pdserve does not implement (400), prompt and completion length against
max_model_len (400, code context_length_exceeded), token ids against the vocabulary (400), the
chat template rendering (400).

Tokenizing holds the GIL (a multi-MB prompt stalls the router for seconds), so text that cannot
fit the context whatever it tokenizes to is refused before it is tokenized: no token spans more
than `max_token_chars` characters, and normalizers shrink text by less than NORMALIZER_SLACK.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
from pydantic import ValidationError

from pdserve.router.openai_protocol import INT64_MAX, ChatCompletionRequest, CompletionRequest, _Request
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError

NORMALIZER_SLACK = 4  # Unicode composition merges at most 3 characters into 1


@dataclass
class Prepared:
    """One choice per prompt: a completions batch has several, chat has one."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    logprobs: int | None  # top-N alternatives requested, None for no logprobs


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer, served_model_name: str, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.vocab_size = vocab_size
        self.max_token_chars = max(len(tokenizer.id_to_token(i) or "") for i in range(len(tokenizer))) or 1

    def completion(self, req: CompletionRequest, max_model_len: int) -> Prepared:
        self._common(req)
        for flag, bad in (("echo", req.echo), ("suffix", req.suffix is not None), ("best_of", (req.best_of or 1) > 1)):
            if bad:
                raise OpenAIError(400, f"{flag} is not supported by pdserve", param=flag, code="unsupported_parameter")
        prompts = [self._prompt_ids(p, max_model_len) for p in req.prompts()]
        params = [self._params(req, len(ids), max_model_len, req.max_tokens, req.logprobs) for ids in prompts]
        return Prepared(prompts, params, req.logprobs)

    def chat(self, req: ChatCompletionRequest, max_model_len: int) -> Prepared:
        self._common(req)
        if req.tools:
            raise OpenAIError(400, "tools are not supported by pdserve", param="tools", code="unsupported_parameter")
        fmt = req.response_format.type if req.response_format is not None else "text"
        if fmt != "text":
            raise OpenAIError(
                400,
                f"response_format {fmt!r} is not supported (only 'text')",
                param="response_format",
                code="unsupported_parameter",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
        self._fits_untokenized(sum(len(m["content"]) for m in messages), max_model_len, "messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=True
            )
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise OpenAIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        if not ids:
            raise OpenAIError(400, "the messages render to an empty prompt", param="messages")
        params = self._params(req, len(ids), max_model_len, req.token_limit(), logprobs)
        return Prepared([list(ids)], [params], logprobs)

    # -- shared --
    def _common(self, req: _Request) -> None:
        if req.model is not None and req.model != self.served_model_name:
            raise OpenAIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if req.n != 1:
            raise OpenAIError(
                400,
                f"n={req.n} is not supported: pdserve returns one choice per prompt (n=1)",
                param="n",
                code="unsupported_parameter",
            )
        if req.logit_bias:
            raise OpenAIError(
                400, "logit_bias is not supported by pdserve", param="logit_bias", code="unsupported_parameter"
            )
        if req.stop_token_ids and any(not 0 <= t < self.vocab_size for t in req.stop_token_ids):
            raise OpenAIError(400, f"stop_token_ids must lie in [0, {self.vocab_size})", param="stop_token_ids")

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
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValidationError as e:  # rules across fields, e.g. min_tokens <= max_tokens
            first = e.errors()[0]
            msg = first["msg"].removeprefix("Value error, ")
            param = ".".join(str(p) for p in first["loc"]) or next(
                (f for f in ("min_tokens", "max_tokens") if f in msg), None
            )
            raise OpenAIError(400, f"{param + ': ' if first['loc'] else ''}{msg}", param=param) from None
