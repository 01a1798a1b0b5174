"""E2B-compatible REST facade (aiohttp) over the same manager the gRPC service uses.

E2B's control-plane routes (`/sandboxes`, `/sandboxes/{id}`, `/pause`, `/resume`, `/timeout`) keep E2B's
field names (sandboxID, templateID, timeout, envVars) so existing clients can point here; AgentENV-style
extensions add `/fork` and `/snapshots`, and `/commands` and `/files` stand in for E2B's in-sandbox envd
daemon. The tenant comes from the `X-Tenant` header, or else from E2B's `X-API-Key` (as a hash, so the key
itself never shows up in listings or logs). Errors are JSON `{"code", "message"}`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import grpc
from aiohttp import web

from services.sandbox.backends.base import SANDBOX_HOME, ExecSpec, collect
from services.sandbox.errors import InvalidRequest, SandboxError
from services.sandbox.limits import LimitRequest
from services.sandbox.manager import SandboxManager
from services.sandbox.record import Sandbox

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sandbox_json(sb: Sandbox) -> dict:
    lim = sb.handle.limits
    return {
        "sandboxID": sb.sandbox_id, "templateID": sb.handle.image.name, "clientID": sb.tenant,
        "state": "paused" if sb.paused else "running", "backend": sb.backend.name,
        "memoryReleased": sb.handle.hibernated,
        "startedAt": datetime.fromtimestamp(sb.created, UTC).isoformat(),
        "cpuCount": max(1, lim.cpu_millis // 1000), "memoryMB": lim.memory_bytes >> 20,
        "diskSizeMB": lim.disk_bytes >> 20, "timeout": int(sb.ttl_s), "snapshots": list(sb.snapshots),
    }


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxError as e:
        status = _HTTP_STATUS.get(e.code, 500)
        return web.json_response({"code": status, "message": e.message}, status=status)


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest("body", f"not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    return body


def _tenant(request: web.Request) -> str:
    if "X-Tenant" in request.headers:
        return request.headers["X-Tenant"]
    key = request.headers.get("X-API-Key", "")
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def _int(body: dict, key: str, default: int = 0) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(key, f"must be a non-negative integer, got {value!r}")
    return value


def _string_map(body: dict, key: str) -> dict[str, str]:
    value = body.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidRequest(key, f"must be an object of string values, got {value!r}")
    return value


def rest_app(manager: SandboxManager) -> web.Application:
    routes = web.RouteTableDef()

    @routes.post("/sandboxes")
    async def create(request: web.Request) -> web.Response:
        body = await _body(request)
        if "snapshotID" in body:  # AgentENV-style: start a sandbox from a snapshot
            sb, _ = await manager.restore(str(body["snapshotID"]))
        else:
            sb = await manager.create(
                image=str(body.get("templateID", "base")), tenant=_tenant(request),
                backend=str(body.get("backend", "")),
                limits=LimitRequest(memory_bytes=_int(body, "memoryMB") << 20,
                                    cpu_millis=_int(body, "cpuCount") * 1000,
                                    disk_bytes=_int(body, "diskSizeMB") << 20,
                                    network=bool(body.get("allowInternetAccess", False))),
                idle_pause_s=_int(body, "autoPauseAfter"), ttl_s=_int(body, "timeout"),
                snapshot_interval_s=_int(body, "snapshotInterval"), env=_string_map(body, "envVars"))
        return web.json_response(sandbox_json(sb), status=201)

    @routes.get("/sandboxes")
    async def list_(request: web.Request) -> web.Response:
        return web.json_response([sandbox_json(s) for s in manager.list(_tenant(request))])

    @routes.get("/sandboxes/{id}")
    async def get(request: web.Request) -> web.Response:
        return web.json_response(sandbox_json(manager.get(request.match_info["id"])))

    @routes.delete("/sandboxes/{id}")
    async def destroy(request: web.Request) -> web.Response:
        await manager.destroy(request.match_info["id"])
        return web.Response(status=204)

    @routes.post("/sandboxes/{id}/pause")
    async def pause(request: web.Request) -> web.Response:
        body = await _body(request)
        await manager.pause(request.match_info["id"], release_memory=bool(body.get("releaseMemory", False)))
        return web.Response(status=204)

    @routes.post("/sandboxes/{id}/resume")
    async def resume(request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        body = await _body(request)  # checked first: a bad body must not leave the sandbox resumed
        ttl = _int(body, "timeout") if "timeout" in body else None
        await manager.resume(sid)
        if ttl is not None:
            manager.set_ttl(sid, ttl)
        return web.json_response(sandbox_json(manager.get(sid)), status=201)

    @routes.post("/sandboxes/{id}/timeout")
    async def timeout(request: web.Request) -> web.Response:
        manager.set_ttl(request.match_info["id"], _int(await _body(request), "timeout"))
        return web.Response(status=204)

    @routes.post("/sandboxes/{id}/fork")
    async def fork(request: web.Request) -> web.Response:
        children, ms = await manager.fork(request.match_info["id"], _int(await _body(request), "count", 1))
        return web.json_response({"sandboxes": [sandbox_json(s) for s in children], "tookMs": ms}, status=201)

    @routes.post("/sandboxes/{id}/snapshots")
    async def snapshot(request: web.Request) -> web.Response:
        snap, ms = await manager.snapshot(request.match_info["id"])
        return web.json_response({"snapshotID": snap.ref.snapshot_id, "memory": snap.ref.memory, "tookMs": ms},
                                 status=201)

    @routes.get("/snapshots")
    async def list_snapshots(request: web.Request) -> web.Response:
        tenant = _tenant(request)
        return web.json_response([
            {"snapshotID": sid, "sandboxID": s.source, "memory": s.ref.memory, "backend": s.ref.backend}
            for sid, s in manager.snapshots.items() if not tenant or s.tenant == tenant])

    @routes.delete("/snapshots/{sid}")
    async def delete_snapshot(request: web.Request) -> web.Response:
        manager.delete_snapshot(request.match_info["sid"])
        return web.Response(status=204)

    @routes.post("/snapshots/{sid}/restore")
    async def restore(request: web.Request) -> web.Response:
        sb, ms = await manager.restore(request.match_info["sid"])
        return web.json_response({**sandbox_json(sb), "tookMs": ms}, status=201)

    @routes.post("/sandboxes/{id}/commands")
    async def command(request: web.Request) -> web.Response:
        body = await _body(request)
        cmd = body.get("cmd")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else cmd
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidRequest("cmd", "must be a shell string or a non-empty list of strings")
        spec = ExecSpec(argv=argv, stdin=str(body.get("stdin", "")).encode(), timeout_s=_int(body, "timeout"),
                        cwd=str(body.get("cwd") or SANDBOX_HOME), env=_string_map(body, "envs"),
                        background=bool(body.get("background", False)))
        result = await collect(manager.exec(request.match_info["id"], spec))
        return web.json_response({"stdout": result.stdout.decode(errors="replace"),
                                  "stderr": result.stderr.decode(errors="replace"), "exitCode": result.exit_code})

    @routes.get("/sandboxes/{id}/files")
    async def read_file(request: web.Request) -> web.Response:
        data = await manager.read_file(request.match_info["id"], request.query.get("path", ""))
        return web.Response(body=data, content_type="application/octet-stream")

    @routes.post("/sandboxes/{id}/files")
    async def write_file(request: web.Request) -> web.Response:
        path = request.query.get("path", "")
        data = await request.read()
        if request.headers.get("Content-Transfer-Encoding") == "base64":
            try:
                data = base64.b64decode(data)
            except binascii.Error as e:
                raise InvalidRequest("body", f"not valid base64: {e}") from e
        n = await manager.write_file(request.match_info["id"], path, data, 0o644)
        return web.json_response({"path": path, "size": n})

    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app.add_routes(routes)
    return app
