"""Request options as short natural-language option messages (app. F: low alignment tax).

Global options (tool declarations, thinking effort) are rendered before the input messages: they
rarely change and changing them invalidates the cache anyway. One-shot options (tool_choice,
response_format) are rendered after the input messages, so changing them per request keeps the
cached history intact.
"""

from __future__ import annotations

from typing import Any

from k3core.chat.tool_args import compact_json
from k3core.chat.xtml import ChatTemplateError

REASONING_EFFORTS = ("low", "medium", "high", "max")
_EFFORT_TEXT = {
    "low": "Reasoning effort: low. Think briefly and answer directly.",
    "medium": "Reasoning effort: medium. Think as much as the task needs, no more.",
    "high": "Reasoning effort: high. Think thoroughly before answering.",
    "max": "Reasoning effort: max. Use as much reasoning as helps, checking your work.",
}


def tool_functions(tools: list[dict[str, Any]] | None, field: str = "tools") -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI-style tool declarations, checked."""
    functions = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatTemplateError(f"{field}[{i}]: only type 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatTemplateError(f"{field}[{i}].function.name: required non-empty string")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatTemplateError(f"{field}[{i}].function.parameters: must be a JSON-schema object")
        functions.append(function)
    return functions


def tool_declare_text(functions: list[dict[str, Any]]) -> str:
    return "\n".join(compact_json(f) for f in functions)


def effort_text(effort: str) -> str:
    if effort not in REASONING_EFFORTS:
        raise ChatTemplateError(f"reasoning_effort: must be one of {list(REASONING_EFFORTS)}, got {effort!r}")
    return _EFFORT_TEXT[effort]


def tool_choice_text(tool_choice: Any, declared: set[str]) -> str | None:
    """Instruction for ``tool_choice``; None for the default ("auto" or absent)."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "none":
        return "Do not call any tool in this reply."
    if tool_choice == "required":
        if not declared:
            raise ChatTemplateError("tool_choice: 'required' but no tools are declared")
        return "Call at least one tool in this reply."
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ChatTemplateError(
            "tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    if name not in declared:
        raise ChatTemplateError(f"tool_choice.function.name: {name!r} is not a declared tool")
    return f"Call the tool {name} in this reply."


def response_format_text(response_format: Any) -> str | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "Reply with a single JSON object and nothing else."
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ChatTemplateError("response_format.json_schema.schema: required JSON-schema object")
        return (
            "Reply with a single JSON object and nothing else, conforming to this JSON schema: "
            + compact_json(spec["schema"])
        )
    raise ChatTemplateError(f"response_format.type: expected text, json_object or json_schema, got {kind!r}")
