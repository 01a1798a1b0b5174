"""`k3 serve decode`: the decode worker (continuous batching, streaming, disaggregated decode)."""

from __future__ import annotations

from k3.v1 import decode_pb2_grpc
from services.decode.servicer import DecodeServicer
from services.engine.config import WorkerConfig
from services.engine.service import WorkerService
from services.runtime import ServiceApp


def main(argv: list[str]) -> None:
    config = WorkerConfig.load("decode", argv)
    app = ServiceApp("decode", config)
    service = WorkerService(app, config, "decode")
    app.add_service(decode_pb2_grpc.add_DecodeServiceServicer_to_server, DecodeServicer(service),
                    "k3.v1.DecodeService")
    app.run()
