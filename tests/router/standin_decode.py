"""A STAND-IN decode worker for router tests (the real decode service is another team's and needs a model).

It is a real process with a real gRPC server registered in etcd under a real lease, answering only the two
calls the router makes: ProbePrefix (claims `hit_tokens` of any probed chain) and GetDecodeLoad.
Run as `k3 serve tests.router.standin_decode --cluster c0 --hit-tokens 1024 --running 2 ...`.
"""

from __future__ import annotations

import dataclasses

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.runtime import ServiceApp, ServiceConfig


@dataclasses.dataclass
class StandinDecodeConfig(ServiceConfig):
    hit_tokens: int = 0
    running: int = 0


class StandinDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, config: StandinDecodeConfig):
        self.config = config

    async def ProbePrefix(self, request, context):
        covered = len(request.block_hashes) * request.hash_block_tokens
        return decode_pb2.ProbePrefixResponse(hit_tokens=min(self.config.hit_tokens, covered))

    async def GetDecodeLoad(self, request, context):
        return decode_pb2.GetDecodeLoadResponse(load=common_pb2.WorkerLoad(running=self.config.running))


def main(argv: list[str]) -> None:
    config = StandinDecodeConfig.load("decode", argv)
    app = ServiceApp("decode", config)
    app.add_service(decode_pb2_grpc.add_DecodeServiceServicer_to_server, StandinDecode(config),
                    "k3.v1.DecodeService")
    app.run()
