"""Service errors and their mapping onto gRPC status codes.

Servicers raise these; the runtime's interceptor turns them into a status with a message, an `ErrorDetail`
in the `k3-error-bin` trailer and, for retriable errors, a `retry-after-ms` trailer.
"""

from __future__ import annotations

import grpc

from k3.v1 import common_pb2

ERROR_TRAILER = "k3-error-bin"
RETRY_AFTER_TRAILER = "retry-after-ms"


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retriable = False

    def __init__(self, message: str, *, field: str = "", retry_after_ms: int = 0):
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after_ms = retry_after_ms

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(
            code=self.code.name,
            message=self.message,
            field=self.field,
            retry_after_ms=self.retry_after_ms,
            retriable=self.retriable,
        )

    def trailers(self) -> tuple[tuple[str, str | bytes], ...]:
        out: list[tuple[str, str | bytes]] = [(ERROR_TRAILER, self.detail().SerializeToString())]
        if self.retry_after_ms:
            out.append((RETRY_AFTER_TRAILER, str(self.retry_after_ms)))
        return tuple(out)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message, field=field)


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retriable = True


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retriable = True

    def __init__(self, message: str, *, retry_after_ms: int = 1000, field: str = ""):
        super().__init__(message, field=field, retry_after_ms=retry_after_ms)


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    retriable = True

    def __init__(self, message: str, *, retry_after_ms: int = 0):
        super().__init__(message, retry_after_ms=retry_after_ms)


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


def error_detail(err: grpc.RpcError) -> common_pb2.ErrorDetail | None:
    """The ErrorDetail a K3 service attached to a failed call, if any (client side)."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == ERROR_TRAILER:
            return common_pb2.ErrorDetail.FromString(value)
    return None
