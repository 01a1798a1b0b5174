"""The OpenAI-compatible HTTP API: /v1/chat/completions and /v1/completions (SSE when streaming),
/v1/models, and /healthz. Errors use OpenAI's error format with a 4xx/5xx status."""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from services.gateway.frontend import Frontend
from services.gateway.logprobs import openai_content
from services.gateway.openai_request import RequestError, parse
from services.runtime import errors
from services.runtime.interceptors import CallTracker

log = logging.getLogger("k3.gateway.http")
MAX_BODY_BYTES = 16 * 1024 * 1024


def build_app(frontend: Frontend, max_output_tokens: int, tracker: CallTracker,
              auth_token: str = "") -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_middleware(tracker, auth_token)])
    app["frontend"], app["max_output_tokens"] = frontend, max_output_tokens
    app.router.add_post("/v1/chat/completions", lambda r: _complete(r, chat=True))
    app.router.add_post("/v1/completions", lambda r: _complete(r, chat=False))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", lambda r: web.json_response({"status": "ok"}))
    return app


def _errors_middleware(tracker: CallTracker, auth_token: str):
    """Auth, drain (503 while draining; in-flight requests count towards the drain) and error mapping."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path.startswith("/v1/"):
            if tracker.draining:
                return _service_error_response(errors.Unavailable("gateway is draining", retry_after_ms=1000))
            tracker.enter()
        try:
            if auth_token and request.path.startswith("/v1/"):
                if request.headers.get("authorization", "") != f"Bearer {auth_token}":
                    raise RequestError(401, "missing or wrong API key", None, "invalid_api_key",
                                       "authentication_error")
            return await handler(request)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except errors.ServiceError as exc:
            return _service_error_response(exc)
        except web.HTTPException as exc:
            body = RequestError(exc.status, exc.reason or "error").body()
            return web.json_response(body, status=exc.status)
        finally:
            if request.path.startswith("/v1/"):
                tracker.leave()
    return middleware


def _service_error_response(exc: errors.ServiceError) -> web.Response:
    status = {"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404,
              "DEADLINE_EXCEEDED": 504}.get(exc.code.name, 500)
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    headers = {"retry-after": str(max(1, round(exc.retry_after_ms / 1000)))} if exc.retry_after_ms else None
    body = RequestError(status, exc.message, exc.field or None, exc.code.name.lower(), kind).body()
    return web.json_response(body, status=status, headers=headers)


async def _models(request: web.Request) -> web.Response:
    frontend: Frontend = request.app["frontend"]
    return web.json_response({"object": "list", "data": [
        {"id": frontend.model, "object": "model", "created": 0, "owned_by": "k3serve"}]})


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    frontend: Frontend = request.app["frontend"]
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from exc
    parsed = parse(body, chat=chat, served_model=frontend.model, max_output_tokens=request.app["max_output_tokens"],
                   session_header=request.headers.get("x-session-id", ""))
    prepared = frontend.prepare(parsed)
    job = prepared.job
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": job.request_id, "created": created, "model": frontend.model}
    if not parsed.stream:
        return await _whole(frontend, prepared, base, kind, chat, parsed.logprobs)

    response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                           "x-session-id": parsed.session_id})
    started = False
    completion_tokens = cached = 0
    try:
        async for delta in frontend.stream(prepared):
            if not started:
                await response.prepare(request)
                started = True
                if chat:
                    await _sse(response, {**base, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                        "system_fingerprint": f"k3:{delta.cluster}"})
            completion_tokens += len(delta.token_ids)
            cached = max(cached, delta.cached_tokens)
            choice = ({"index": 0, "delta": _chat_delta(delta), "finish_reason": delta.finish_reason} if chat else
                      {"index": 0, "text": delta.text, "finish_reason": delta.finish_reason})
            if parsed.logprobs:
                choice["logprobs"] = {"content": openai_content(frontend.tokenizer, delta.logprobs), "refusal": None}
            # system_fingerprint names the cluster that produced the chunk (it changes on failover).
            await _sse(response, {**base, "object": "chat.completion.chunk" if chat else kind, "choices": [choice],
                                  "system_fingerprint": f"k3:{delta.cluster}"})
    except errors.ServiceError as exc:
        if not started:
            return _service_error_response(exc)
        # Mid-stream failure that could not be resumed: say so in-band, then end the stream.
        await _sse(response, RequestError(503, exc.message, None, exc.code.name.lower(), "server_error").body())
    if parsed.include_usage:
        await _sse(response, {**base, "object": "chat.completion.chunk" if chat else kind, "choices": [],
                              "usage": _usage(job, completion_tokens, cached)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _chat_delta(delta) -> dict:
    out: dict = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.text:
        out["content"] = delta.text
    if delta.tool_calls:
        out["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta.tool_calls)]
    return out


async def _whole(frontend: Frontend, prepared, base: dict, kind: str, chat: bool, logprobs: bool) -> web.Response:
    text, reasoning, calls, finish, tokens, cached, cluster = [], [], [], None, 0, 0, ""
    content_logprobs: list[dict] = []
    async for delta in frontend.stream(prepared):
        content_logprobs += openai_content(frontend.tokenizer, delta.logprobs)
        text.append(delta.text)
        reasoning.append(delta.reasoning)
        calls.extend(delta.tool_calls)
        tokens += len(delta.token_ids)
        cached = max(cached, delta.cached_tokens)
        finish, cluster = delta.finish_reason or finish, delta.cluster
    content = "".join(text)
    message: dict = {"role": "assistant", "content": content}
    if prepared.thinking:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    choice = ({"index": 0, "message": message, "finish_reason": finish}
              if chat else {"index": 0, "text": content, "finish_reason": finish})
    if logprobs:
        choice["logprobs"] = {"content": content_logprobs, "refusal": None}
    job = prepared.job
    return web.json_response({**base, "object": kind, "choices": [choice], "usage": _usage(job, tokens, cached),
                              "system_fingerprint": f"k3:{cluster}"},
                             headers={"x-k3-cluster": cluster, "x-session-id": job.session.session_id})


def _usage(job, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _sse(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
