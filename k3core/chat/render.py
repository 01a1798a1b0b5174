"""Render an OpenAI-style chat request to XTML tokens (app. F).

Layout: global options | input messages (with interleaved input-option messages) | one-shot options
| generation prefix. See docs/chat-template.md for the full grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from k3core.chat import options as opt
from k3core.chat.tool_args import encode_arg
from k3core.chat.xtml import ChatTemplateError, XtmlWriter
from k3core.tokenizer.protocol import Tokenizer

INPUT_ROLES = ("system", "user", "assistant", "tool")
# An input-option message declares tools mid-conversation (dynamically loaded tools).
TOOL_DECLARE_ROLE = "tool-declare"


@dataclass
class RenderedChat:
    tokens: list[int]
    # Position just after each message's [end_of_msg], options included: turn boundaries where the
    # cache keeps KDA state checkpoints.
    message_ends: list[int]
    # Tokens up to the end of the last input message: what the next turn shares with this one.
    history_len: int
    thinking: bool
    # Declared tool functions by name (global and mid-conversation), for the output parser.
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    reasoning_effort: str | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
) -> RenderedChat:
    w = XtmlWriter(tokenizer)
    declared = {f["name"]: f for f in opt.tool_functions(tools)}
    if declared:
        w.message("option", opt.tool_declare_text(list(declared.values())), {"type": "tool-declare"})
    if reasoning_effort is not None:
        w.message("option", opt.effort_text(reasoning_effort), {"type": "thinking-effort"})
    _render_messages(w, messages, declared, thinking)
    history_len = len(w.tokens)
    choice = opt.tool_choice_text(tool_choice, set(declared))
    if choice is not None:
        w.message("option", choice, {"type": "tool-choice"})
    fmt = opt.response_format_text(response_format)
    if fmt is not None:
        w.message("option", fmt, {"type": "response-format"})
    if add_generation_prompt:
        w.open("assistant")
        w.open("think" if thinking else "response")
    return RenderedChat(w.tokens, w.message_ends, history_len, thinking, declared)


def _render_messages(
    w: XtmlWriter, messages: list[dict[str, Any]], declared: dict[str, dict[str, Any]], thinking: bool
) -> None:
    last_calls: list[dict[str, Any]] = []
    results_seen = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == TOOL_DECLARE_ROLE:
            functions = opt.tool_functions(msg.get("tools"), f"{where}.tools")
            declared.update({f["name"]: f for f in functions})
            w.message("option", opt.tool_declare_text(functions), {"type": "tool-declare"})
        elif role in ("system", "user"):
            w.message(role, _text_content(msg.get("content"), where))
        elif role == "assistant":
            last_calls, results_seen = _assistant_calls(msg, where), 0
            _render_assistant(w, msg, last_calls, thinking, where)
        elif role == "tool":
            call_index = _match_tool_result(msg, last_calls, results_seen, where)
            results_seen += 1
            name = last_calls[call_index]["function"]["name"]
            w.message("tool", _text_content(msg.get("content"), where), {"tool": name, "index": str(call_index)})
        else:
            raise ChatTemplateError(f"{where}.role: expected one of {[*INPUT_ROLES, TOOL_DECLARE_ROLE]}, got {role!r}")


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{where}.content[{j}]: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError(f"{where}.content: expected a string or a list of text parts")


def _assistant_calls(msg: dict[str, Any], where: str) -> list[dict[str, Any]]:
    calls = msg.get("tool_calls") or []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"{where}.tool_calls[{j}].function.name: required string")
    return calls


def _render_assistant(
    w: XtmlWriter, msg: dict[str, Any], calls: list[dict[str, Any]], thinking: bool, where: str
) -> None:
    content = _text_content(msg.get("content"), where)
    w.open("assistant")
    # Preserved thinking: in thinking mode the think channel is always there, even empty, so every
    # turn has the same structure; instruct mode history has only response and tools.
    if thinking:
        w.element("think", msg.get("reasoning_content") or "")
    # Instruct generation starts with [open]response[sep], so there the response channel is always
    # present; in thinking mode it is present when there is something in it (or nothing else).
    if not thinking or content or not calls:
        w.element("response", content)
    if calls:
        w.open("tools")
        for index, call in enumerate(calls):
            _render_call(w, call, index)
        w.close("tools")
    w.end_message()


def _render_call(w: XtmlWriter, call: dict[str, Any], index: int) -> None:
    fn = call["function"]
    w.open("call", {"tool": fn["name"], "index": str(index)})
    raw = fn.get("arguments", "{}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        arguments = None
    if isinstance(arguments, dict):
        for name, value in arguments.items():
            body, attrs = encode_arg(value)
            w.element("arg", body, {"name": name, **attrs})
    else:
        # Plain-JSON fallback for inputs that do not decompose into named arguments; the model never
        # emits it (its loss is masked in training).
        w.element("json", raw if isinstance(raw, str) else json.dumps(raw))
    w.close("call")


def _match_tool_result(msg: dict[str, Any], calls: list[dict[str, Any]], seen: int, where: str) -> int:
    """Index of the call this tool result answers: by tool_call_id, else by position."""
    if not calls:
        raise ChatTemplateError(f"{where}: tool result without a preceding assistant tool call")
    call_id = msg.get("tool_call_id")
    if call_id is not None:
        for index, call in enumerate(calls):
            if call.get("id") == call_id:
                return index
        raise ChatTemplateError(f"{where}.tool_call_id: {call_id!r} matches no call of the last assistant message")
    if seen >= len(calls):
        raise ChatTemplateError(f"{where}: more tool results than the {len(calls)} calls they answer")
    return seen
