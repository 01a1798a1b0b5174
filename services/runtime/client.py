"""Client-side helpers: channels that carry the service token, and a pool of them per peer address."""

from __future__ import annotations

import grpc

DEFAULT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def _bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                        grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = _bearer(token)

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


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = _bearer(token)

    def _with_token(self, details):
        return details._replace(metadata=list(details.metadata or ()) + [self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


def aio_channel(address: str, token: str = "") -> grpc.aio.Channel:
    interceptors = [_TokenInterceptor(token)] if token else None
    return grpc.aio.insecure_channel(address, options=DEFAULT_OPTIONS, interceptors=interceptors)


def sync_channel(address: str, token: str = "") -> grpc.Channel:
    channel = grpc.insecure_channel(address, options=DEFAULT_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(token))
    return channel


class ChannelPool:
    """One aio channel per peer address, opened on first use and reused: a channel is a connection, so a
    service that calls the same peers for every request must not open one per call."""

    def __init__(self, token: str = ""):
        self.token = token
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __call__(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.token)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
