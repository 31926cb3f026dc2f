"""DeepSeek-V4's prompt encoding: the release ships a Python reference encoder and no Jinja
template, so pdserve writes the same text itself. tests/fixtures/dsv4_encoding.json holds the
reference's output on its own inputs and ours; tests/unit/test_chat_dsv4.py compares.

    BOS, then each message:
      system           its text, then the tools section and the response format it carries
      developer        <｜User｜> + text (+ tools, response format)
      user             <｜User｜> + text blocks and <tool_result> blocks, joined by blank lines
      latest_reminder  <｜latest_reminder｜> + text
      assistant        [reasoning + </think>] + content + [DSML tool calls] + EOS
    after a user/developer turn that the model answers: <｜Assistant｜> then <think> (thinking
    mode) or </think> (chat mode).

`tool` messages join the user turn that follows them as <tool_result> blocks, ordered as the
assistant called them. In thinking mode, reasoning of turns before the last user turn is dropped
unless some message carries tools, and the reasoning effort's text (EFFORT_PROMPTS) starts the
first message. The encoder has had two revisions, which differ only in those texts:

    original  DeepSeek-V4-Flash / -Pro as first released: "high" (and None) no text, "max" ABSOLUTE_MAX
    0731      DeepSeek-V4-Flash-0731 and later: "low" (and None) no text, "high" ABSOLUTE_MAX, "max" BEYOND_MAX

(chat/dsv4_revision.py tells which one a checkpoint has.)
"""

from __future__ import annotations

import copy
import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title", "read_url")}
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, REMINDER, THINK, END_THINK, DSML, *TASK_TOKENS.values())

# The model was trained on these exact words: they are protocol, not prose to edit.
ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# Each revision's effort levels -> the text before the first message in thinking mode (None: the default level).
EFFORT_PROMPTS: dict[str, dict[str | None, str]] = {
    "original": {None: "", "high": "", "max": ABSOLUTE_MAX},
    "0731": {None: "", "low": "", "high": ABSOLUTE_MAX, "max": BEYOND_MAX},
}
REVISIONS = tuple(EFFORT_PROMPTS)
_TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def to_json(value: Any) -> str:
    """JSON as the encoder writes it: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict]) -> str:
    """The system prompt's tool section for OpenAI-style tools ({"type": "function", "function": {...}})."""
    return _TOOLS_HEAD + "\n".join(to_json(t["function"]) for t in tools) + _TOOLS_TAIL


def dsml_tool_calls(tool_calls: list[dict]) -> str:
    """An assistant turn's OpenAI-style tool calls as the DSML block the model writes."""
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>"
            for k, v in _arguments(fn["arguments"]).items()
        )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _arguments(raw: Any) -> dict:
    # A call's arguments are a JSON object in a string; anything else is kept whole under "arguments".
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {"arguments": raw}
    if not isinstance(value, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(value).__name__}")
    return value


def encode(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
    revision: str = "original",
) -> str:
    """The prompt for `messages` (reference-encoder dicts: roles system, developer, user, assistant,
    tool, latest_reminder; tools / response_format on a system or developer message), as the
    encoder of `revision` writes it."""
    if revision not in EFFORT_PROMPTS:
        raise ValueError(f"revision must be one of {', '.join(REVISIONS)}, got {revision!r}")
    efforts = EFFORT_PROMPTS[revision]
    if reasoning_effort not in efforts:
        raise ValueError(
            f"reasoning_effort must be one of {tuple(efforts)} (revision {revision}), got {reasoning_effort!r}"
        )
    chat = _order_tool_results(_merge_tool_results(messages))
    keep = not drop_thinking or any(m.get("tools") for m in chat)
    if thinking and not keep:
        chat = _drop_old_reasoning(chat)
    last_user = max((i for i, m in enumerate(chat) if m.get("role") in ("user", "developer")), default=-1)
    parts = [BOS]
    for i in range(len(chat)):
        parts.append(_message(i, chat, thinking, keep, last_user))
        if i == 0 and thinking:
            parts[-1] = efforts[reasoning_effort] + parts[-1]
        last = i + 1 == len(chat)
        if last and not add_generation_prompt:
            continue
        if last or chat[i + 1].get("role") in ("assistant", "latest_reminder"):
            parts.append(_turn_end(i, chat, thinking, keep, last_user))
    return "".join(parts)


def _message(i: int, chat: list[dict], thinking: bool, keep: bool, last_user: int) -> str:
    m = chat[i]
    role = m.get("role")
    if role in ("system", "developer"):
        if role == "developer" and not m.get("content"):
            raise ValueError("a developer message needs content")
        text = (USER if role == "developer" else "") + (m.get("content") or "")
        if m.get("tools"):
            text += "\n\n" + tools_section(m["tools"])
        if m.get("response_format"):
            text += "\n\n" + _RESPONSE_FORMAT + to_json(m["response_format"])
        return text
    if role == "user":
        blocks = m.get("content_blocks")
        return USER + ("\n\n".join(_block(b) for b in blocks) if blocks else m.get("content") or "")
    if role == "latest_reminder":
        return REMINDER + m["content"]
    if role == "assistant":
        reasoning = ""
        after_task = i > 0 and chat[i - 1].get("task") is not None
        if thinking and not after_task and (keep or i > last_user):
            reasoning = (m.get("reasoning_content") or "") + END_THINK
        calls = dsml_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
        return reasoning + (m.get("content") or "") + calls + ("" if m.get("wo_eos") else EOS)
    raise ValueError(f"unknown message role {role!r}")


def _turn_end(i: int, chat: list[dict], thinking: bool, keep: bool, last_user: int) -> str:
    m = chat[i]
    task = m.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}: expected one of {sorted(TASK_TOKENS)}")
        if task != "action":
            return TASK_TOKENS[task]
        return ASSISTANT + (THINK if thinking else END_THINK) + TASK_TOKENS[task]
    if m.get("role") not in ("user", "developer"):
        return ""
    return ASSISTANT + (THINK if thinking and (keep or i >= last_user) else END_THINK)


def _block(block: dict) -> str:
    kind = block.get("type")
    if kind == "text":
        return block.get("text", "")
    if kind != "tool_result":
        return f"[Unsupported {kind}]"
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n\n".join(
            b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]" for b in content
        )
    return f"<tool_result>{content}</tool_result>"


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Tool results and the user text after them become one user turn of blocks."""
    out: list[dict] = []
    for m in messages:
        m = copy.deepcopy(m)
        role = m.get("role")
        open_turn = out and out[-1].get("role") == "user" and "content_blocks" in out[-1]
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""), "content": m.get("content", "")}
            if open_turn:
                out[-1]["content_blocks"].append(block)
            else:
                out.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": m.get("content", "")}
            if open_turn and out[-1].get("task") is None:
                out[-1]["content_blocks"].append(block)
            else:
                turn = {"role": "user", "content": m.get("content", ""), "content_blocks": [block]}
                turn.update({k: m[k] for k in ("task", "wo_eos", "mask") if k in m})
                out.append(turn)
        else:
            out.append(m)
    return out


def _order_tool_results(chat: list[dict]) -> list[dict]:
    """Each user turn's tool results in the order of the latest assistant turn's calls."""
    order: dict[str, int] = {}
    for m in chat:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            ids = [c.get("id") or c.get("function", {}).get("id", "") for c in m["tool_calls"]]
            order = {cid: n for n, cid in enumerate(ids) if cid}
        elif m.get("role") == "user" and m.get("content_blocks") and order:
            results = [b for b in m["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                m["content_blocks"] = [
                    next(ranked) if b.get("type") == "tool_result" else b for b in m["content_blocks"]
                ]
    return chat


def _drop_old_reasoning(chat: list[dict]) -> list[dict]:
    """Before the last user turn: assistant reasoning removed, developer turns removed."""
    last_user = max((i for i, m in enumerate(chat) if m.get("role") in ("user", "developer")), default=-1)
    out = []
    for i, m in enumerate(chat):
        role = m.get("role")
        if i >= last_user or role in ("user", "system", "tool", "latest_reminder", "direct_search_results"):
            out.append(m)
        elif role == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return out
