"""One server interceptor doing what every call needs: auth, draining, request ids, deadlines, metrics,
and the mapping of exceptions onto gRPC status codes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.runtime import errors
from services.runtime.logs import request_id_var
from services.runtime.metrics import RPC_IN_FLIGHT, RPC_LATENCY, RPC_REQUESTS

log = logging.getLogger("k3.rpc")

# Probes (kubelet, load balancers) cannot carry the service token.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class CallTracker:
    """Counts in-flight calls so a draining server knows when it may exit."""

    def __init__(self) -> None:
        self.active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


class RuntimeInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, tracker: CallTracker, auth_token: str = ""):
        self.service = service
        self.tracker = tracker
        self.auth_token = auth_token.encode()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        metadata = dict(details.invocation_metadata or ())
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, metadata),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method, metadata),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method, metadata),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, method, metadata),
            handler.request_deserializer, handler.response_serializer)

    def _admit(self, metadata: dict) -> None:
        if self.tracker.draining:
            raise errors.Unavailable("server is draining; retry on another instance", retry_after_ms=100)
        if self.auth_token:
            given = str(metadata.get("authorization", "")).removeprefix("Bearer ").encode()
            if not hmac.compare_digest(given, self.auth_token):
                raise errors.Unauthenticated("missing or wrong service token (authorization: Bearer ...)")

    def _wrap_unary(self, behavior: Callable, method: str, metadata: dict) -> Callable:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with _CallScope(self, method, metadata, context) as scope:
                try:
                    self._admit(metadata)
                    remaining = context.time_remaining()
                    # Stop working for a caller that has already given up.
                    return await asyncio.wait_for(behavior(request, context), remaining)
                except BaseException as exc:  # noqa: BLE001 - mapped onto a status below
                    await scope.fail(exc)
        return wrapper

    def _wrap_stream(self, behavior: Callable, method: str, metadata: dict) -> Callable:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with _CallScope(self, method, metadata, context) as scope:
                try:
                    self._admit(metadata)
                    async for item in behavior(request, context):
                        yield item
                except BaseException as exc:  # noqa: BLE001 - mapped onto a status below
                    await scope.fail(exc)
        return wrapper


class _CallScope:
    def __init__(self, owner: RuntimeInterceptor, method: str, metadata: dict, context: Any):
        self.owner, self.method, self.context = owner, method, context
        self.request_id = str(metadata.get("x-request-id") or uuid.uuid4().hex[:16])
        self.code = grpc.StatusCode.OK

    def __enter__(self) -> _CallScope:
        self.start = time.perf_counter()
        self.token = request_id_var.set(self.request_id)
        self.owner.tracker.enter()
        RPC_IN_FLIGHT.labels(self.owner.service).inc()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.owner.tracker.leave()
        RPC_IN_FLIGHT.labels(self.owner.service).dec()
        RPC_REQUESTS.labels(self.owner.service, self.method, self.code.name).inc()
        RPC_LATENCY.labels(self.owner.service, self.method).observe(time.perf_counter() - self.start)
        request_id_var.reset(self.token)

    async def fail(self, exc: BaseException) -> None:
        """Turn any exception into a gRPC status (this call never returns normally)."""
        if isinstance(exc, asyncio.CancelledError):
            self.code = grpc.StatusCode.CANCELLED
            raise exc
        if isinstance(exc, grpc.aio.AbortError):
            self.code = self.context.code() or grpc.StatusCode.UNKNOWN
            raise exc
        if isinstance(exc, TimeoutError):
            exc = errors.DeadlineExceeded("deadline exceeded before the call finished")
        if not isinstance(exc, errors.ServiceError):
            log.exception("unhandled error in %s", self.method, exc_info=exc)
            exc = errors.Internal(f"internal error: {type(exc).__name__}: {exc}")
        elif exc.code == grpc.StatusCode.INTERNAL:
            log.error("internal error in %s: %s", self.method, exc.message)
        self.code = exc.code
        self.context.set_trailing_metadata(exc.trailers())
        await self.context.abort(exc.code, exc.message)
