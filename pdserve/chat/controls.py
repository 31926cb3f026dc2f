"""A chat request's controls: thinking on or off, reasoning effort, chat_template_kwargs, and the
server's defaults (--default-chat-template-kwargs), resolved into the kwargs of
Tokenizer.apply_chat_template. Nothing is ignored: a value pdserve does not know, two that
disagree, or one the model's chat template never reads is a ControlError naming the field.

    thinking: request `thinking: {"type": "enabled" | "disabled"}` (DeepSeek's API),
              `chat_template_kwargs.thinking` or `.enable_thinking` (vLLM's, booleans);
              else the server default; else `reasoning_effort` turns it on; else the template's own
    reasoning_effort: `reasoning_effort` or `chat_template_kwargs.reasoning_effort` (OpenAI's names);
              it needs thinking on. The DeepSeek-V4 encoder's levels differ by revision
              (chat/dsv4.py); OpenAI's names map onto them as vLLM's deepseek_v4 tokenizer maps them:

                  OpenAI          minimal  low   medium  high   xhigh  max
                  V4 original     high     high  high    high   max    max
                  V4 0731         low      low   low     high   high   max

              so minimal / low / medium get no text and xhigh the "Absolute maximum" text in both.
"""

from __future__ import annotations

from typing import Any

from pdserve.chat.jinja import SPECIAL_TOKEN_NAMES

EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")
V4_EFFORTS = {
    "original": dict(zip(EFFORTS, ("high", "high", "high", "high", "max", "max"))),
    "0731": dict(zip(EFFORTS, ("low", "low", "low", "high", "high", "max"))),
}
THINKING_KEYS = ("thinking", "enable_thinking")
# Set by the request itself, never through chat_template_kwargs.
RESERVED = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize", "response_format"}
    | {"continue_final_message", *SPECIAL_TOKEN_NAMES}
)
DEFAULTS_FLAG = "--default-chat-template-kwargs"


class ControlError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def resolve(
    *,
    variables: frozenset[str],
    v4_revision: str | None,
    thinking: str | None = None,
    reasoning_effort: str | None = None,
    kwargs: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The apply_chat_template kwargs for these controls. `variables`: what the template reads;
    `v4_revision`: the built-in DeepSeek-V4 encoder's revision (efforts mapped to its levels), None
    for a Jinja template (efforts passed as they are)."""
    kwargs, defaults = dict(kwargs or {}), dict(defaults or {})
    for source, given in (("chat_template_kwargs", kwargs), (DEFAULTS_FLAG, defaults)):
        for key in given:
            if key in RESERVED:
                raise ControlError(f"{source}.{key}", f"{key!r} is set by the request itself, not here")
    votes = _thinking_votes(thinking, kwargs, "chat_template_kwargs") or _thinking_votes(None, defaults, DEFAULTS_FLAG)
    effort = _effort(reasoning_effort, kwargs.pop("reasoning_effort", None), defaults.pop("reasoning_effort", None))
    for key in THINKING_KEYS:
        kwargs.pop(key, None)
        defaults.pop(key, None)
    out: dict[str, Any] = {}
    on = votes[0][1] if votes else None
    if effort is not None and on is False and effort[0].startswith(DEFAULTS_FLAG):
        effort = None  # the server's default effort is for requests that think
    if effort is not None:
        param, value = effort
        if on is False:
            raise ControlError(param, f"reasoning effort needs thinking mode, and {votes[0][0]} turns it off")
        if on is None:
            on, votes = True, [(param, True)]
        if "reasoning_effort" not in variables:
            raise ControlError(param, "this model's chat template has no reasoning effort")
        out["reasoning_effort"] = V4_EFFORTS[v4_revision][value] if v4_revision is not None else value
    if on is not None:
        names = [k for k in THINKING_KEYS if k in variables]
        if not names:
            raise ControlError(votes[0][0], "this model's chat template has no thinking switch")
        out.update({k: on for k in names})
    for source, given in ((DEFAULTS_FLAG, defaults), ("chat_template_kwargs", kwargs)):
        for key, value in given.items():
            if key not in variables:
                raise ControlError(f"{source}.{key}", f"this model's chat template reads no {key!r}")
            out[key] = value
    return out


def _thinking_votes(thinking: str | None, kwargs: dict[str, Any], source: str) -> list[tuple[str, bool]]:
    """(field, on) for every place that says whether to think; ControlError if they disagree."""
    votes = []
    if thinking is not None:
        if thinking not in ("enabled", "disabled"):
            raise ControlError("thinking.type", f"must be 'enabled' or 'disabled', not {thinking!r}")
        votes.append(("thinking.type", thinking == "enabled"))
    for key in THINKING_KEYS:
        if key in kwargs:
            if type(kwargs[key]) is not bool:
                raise ControlError(f"{source}.{key}", f"must be true or false, not {kwargs[key]!r}")
            votes.append((f"{source}.{key}", kwargs[key]))
    for field, on in votes[1:]:
        if on != votes[0][1]:
            raise ControlError(field, f"{field} ({on}) contradicts {votes[0][0]} ({votes[0][1]})")
    return votes


def _effort(request: Any, in_kwargs: Any, default: Any) -> tuple[str, str] | None:
    named = [
        (p, v)
        for p, v in (
            ("reasoning_effort", request),
            ("chat_template_kwargs.reasoning_effort", in_kwargs),
            (f"{DEFAULTS_FLAG}.reasoning_effort", default),
        )
        if v is not None
    ]
    for param, value in named:
        if value not in EFFORTS:
            raise ControlError(param, f"must be one of {', '.join(EFFORTS)}, not {value!r}")
    if len(named) > 1 and not named[1][0].startswith(DEFAULTS_FLAG) and named[1][1] != named[0][1]:
        raise ControlError(named[1][0], f"{named[1][1]!r} contradicts reasoning_effort {named[0][1]!r}")
    return named[0] if named else None
