"""Client-side helpers: channels that carry the service token and request ids."""

from __future__ import annotations

import grpc

DEFAULT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                        grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.metadata)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def aio_channel(address: str, token: str = "") -> grpc.aio.Channel:
    interceptors = [_TokenInterceptor(token)] if token else None
    return grpc.aio.insecure_channel(address, options=DEFAULT_OPTIONS, interceptors=interceptors)


def sync_channel(address: str, token: str = "") -> grpc.Channel:
    channel = grpc.insecure_channel(address, options=DEFAULT_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _SyncToken(token))
    return channel


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ("authorization", f"Bearer {token}")

    def _details(self, details):
        return details._replace(metadata=list(details.metadata or ()) + [self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)
