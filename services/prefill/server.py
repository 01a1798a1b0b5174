"""`k3 serve prefill`: the prefill worker of a disaggregated cluster."""

from __future__ import annotations

from k3.v1 import prefill_pb2_grpc
from services.engine.config import WorkerConfig
from services.engine.service import WorkerService
from services.prefill.servicer import PrefillServicer
from services.runtime import ServiceApp


def main(argv: list[str]) -> None:
    config = WorkerConfig.load("prefill", argv)
    app = ServiceApp("prefill", config)
    service = WorkerService(app, config, "prefill")
    app.add_service(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, PrefillServicer(service),
                    "k3.v1.PrefillService")
    app.run()
