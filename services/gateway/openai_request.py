"""Validation of OpenAI-style request bodies into one internal request, with errors naming the field.

Errors are `RequestError(status, message, param, code)` and are rendered in OpenAI's error format by the
HTTP layer: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

EFFORTS = ("low", "medium", "high")
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class InferenceRequest:
    model: str
    stream: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    # Exactly one of messages (chat) or prompt (completions).
    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: Any = None
    reasoning_effort: str | None = None
    session_id: str = ""
    include_usage: bool = False
    # Chat only: stream each token's log-prob (and the top_logprobs alternatives).
    logprobs: bool = False
    top_logprobs: int = 0


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(400, f"'{name}' must be a number", name, "invalid_type")
    if not low <= value <= high:
        raise RequestError(400, f"'{name}' must be between {low} and {high}, got {value}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer", name, "invalid_type")
    if not low <= value <= high:
        raise RequestError(400, f"'{name}' must be between {low} and {high}, got {value}", name, "invalid_value")
    return value


def parse(body: Any, *, chat: bool, served_model: str, max_output_tokens: int,
          session_header: str = "") -> InferenceRequest:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required", "model", "missing_required_parameter")
    if model != served_model:
        raise RequestError(404, f"The model '{model}' does not exist (this fleet serves '{served_model}')",
                           "model", "model_not_found")
    token_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise RequestError(400, "'stop' must be a non-empty string or a list of up to 16", "stop", "invalid_value")
    stream_options = body.get("stream_options") or {}
    request = InferenceRequest(
        model=model,
        stream=bool(body.get("stream", False)),
        max_tokens=_integer(body, token_key, min(256, max_output_tokens), 1, max_output_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0, 1_000_000),
        seed=_integer(body, "seed", 0, -(2**63), 2**64 - 1) % 2**64,
        stop=stop,
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
    )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty array", "messages", "invalid_value")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES:
                raise RequestError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}",
                                   f"messages[{i}].role", "invalid_value")
        # OpenAI's "developer" role is the system role of older models.
        request.messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        request.tools = body.get("tools")
        if request.tools is not None and not isinstance(request.tools, list):
            raise RequestError(400, "'tools' must be an array", "tools", "invalid_type")
        request.tool_choice = body.get("tool_choice")
        request.response_format = body.get("response_format")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise RequestError(400, f"'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                               "reasoning_effort", "invalid_value")
        request.reasoning_effort = effort
        request.logprobs, request.top_logprobs = parse_logprobs(body)
    else:
        if body.get("logprobs") not in (None, False, 0):
            raise RequestError(400, "'logprobs' is supported on /v1/chat/completions only", "logprobs",
                               "unsupported_parameter")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string", "prompt", "invalid_type")
        request.prompt = prompt
    request.session_id = session_header or derive_session_id(request)
    return request


def parse_logprobs(body: dict) -> tuple[bool, int]:
    """OpenAI chat's `logprobs` (bool) and `top_logprobs` (0..20, only with logprobs)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(400, "'logprobs' must be a boolean", "logprobs", "invalid_type")
    top = body.get("top_logprobs")
    if top is None:
        return bool(wanted), 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(400, f"'top_logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {top!r}",
                           "top_logprobs", "invalid_value")
    if not wanted:
        raise RequestError(400, "'top_logprobs' needs 'logprobs' to be true", "top_logprobs", "invalid_value")
    return True, top


def derive_session_id(request: InferenceRequest) -> str:
    """A conversation keeps its session across turns: hash what every turn repeats (system + first user)."""
    if request.messages is None:
        return "prompt-" + hashlib.sha256((request.prompt or "").encode()).hexdigest()[:24]
    head = [m for m in request.messages if m.get("role") == "system"][:1]
    head += [m for m in request.messages if m.get("role") == "user"][:1]
    canonical = json.dumps([[m.get("role"), m.get("content")] for m in head], sort_keys=True, default=str)
    return "conv-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]
