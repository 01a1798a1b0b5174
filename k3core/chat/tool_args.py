"""Typed tool-call arguments (app. F): strings travel as raw text, other JSON values compact.

    [open]arg name="path"[sep]src/main.py[close]arg[sep]
    [open]arg name="line" type="json"[sep]42[close]arg[sep]

Raw strings make code a first-class argument instead of an escaped JSON string. When the declared
schema says a parameter is not a string, a value written without ``type="json"`` is still read as
JSON, so the schema and the marker agree or the call carries an error.
"""

from __future__ import annotations

import json
from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def encode_arg(value: Any) -> tuple[str, dict[str, str]]:
    """(body text, extra attributes) for one argument value."""
    if isinstance(value, str):
        return value, {}
    return compact_json(value), {"type": "json"}


def _declared_types(schema: dict[str, Any] | None) -> list[str]:
    if not schema or "type" not in schema:
        return []
    declared = schema["type"]
    return [declared] if isinstance(declared, str) else list(declared)


def decode_arg(text: str, attrs: dict[str, str], schema: dict[str, Any] | None) -> Any:
    """Value of one argument; raises ValueError with the reason when it cannot be read."""
    declared = _declared_types(schema)
    as_json = attrs.get("type") == "json" or (declared and "string" not in declared)
    if not as_json:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"value is not JSON: {exc.msg}") from None


def type_errors(name: str, value: Any, schema: dict[str, Any] | None) -> list[str]:
    declared = _declared_types(schema)
    if not declared:
        return []
    # bool is an int subclass in Python but not a JSON integer/number.
    ok = any(
        isinstance(value, _JSON_TYPES.get(t, ())) and not (isinstance(value, bool) and t in ("integer", "number"))
        for t in declared
    )
    if not ok:
        return [f"argument {name!r} should be {'/'.join(declared)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:  # type: ignore[operator]
        return [f"argument {name!r} must be one of {schema['enum']}"]  # type: ignore[index]
    return []


def validate_arguments(arguments: dict[str, Any], parameters: dict[str, Any] | None) -> list[str]:
    """Errors of ``arguments`` against a tool's JSON-schema ``parameters`` (types, enum, required)."""
    if not parameters:
        return []
    properties = parameters.get("properties") or {}
    errors = [f"missing required argument {req!r}" for req in parameters.get("required", []) if req not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            if parameters.get("additionalProperties") is False:
                errors.append(f"unexpected argument {name!r}")
            continue
        errors.extend(type_errors(name, value, properties[name]))
    return errors
