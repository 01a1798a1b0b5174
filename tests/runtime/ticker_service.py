"""A test-only service on the shared runtime: streams `max_tokens` chunks, one every `tick_s`.

It exercises the runtime (drain, deadlines, errors, auth, membership) without a model; the real services are
tested in their own suites. Implements k3.v1.GatewayService because that contract has a server stream.
"""

from __future__ import annotations

import asyncio
import dataclasses

from k3.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.runtime import ServiceApp, ServiceConfig, errors


@dataclasses.dataclass
class TickerConfig(ServiceConfig):
    tick_s: float = 0.05


class Ticker(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, tick_s: float):
        self.tick_s = tick_s

    async def Complete(self, request, context):
        if request.sampling.max_tokens == 0:
            raise errors.InvalidArgument("sampling.max_tokens", "must be > 0")
        if request.sampling.max_tokens > 10_000:
            raise errors.ResourceExhausted("too many tokens", retry_after_ms=250)
        for i in range(request.sampling.max_tokens):
            await asyncio.sleep(self.tick_s)
            yield gateway_pb2.CompleteResponse(chunk=common_pb2.TokenChunk(request_id=request.request_id,
                                                                           token_ids=[i]))

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(id="ticker")])


def main(argv: list[str]) -> None:
    config = TickerConfig.load("ticker", argv)
    app = ServiceApp("ticker", config)
    app.add_service(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, Ticker(config.tick_s),
                    "k3.v1.GatewayService")
    app.run()
