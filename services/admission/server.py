"""The admission controller process: `k3 serve admission [--flags]`."""

from __future__ import annotations

import asyncio

from k3.v1 import admission_pb2_grpc
from services.admission.classifier import RequestClassifier
from services.admission.config import AdmissionConfig
from services.admission.controller import AdmissionController
from services.admission.key_watch import KeyWatcher
from services.admission.replica_view import ReplicaView
from services.admission.service import AdmissionServicer
from services.runtime import ServiceApp
from services.runtime.client import ChannelPool
from services.runtime.registry import Watcher

SWEEP_S = 5.0


def main(argv: list[str]) -> None:
    config = AdmissionConfig.load("admission", argv)
    app = ServiceApp("admission", config)
    classifier = RequestClassifier(config.model(), config.short_max_cost or None, config.medium_max_cost or None)
    controller = AdmissionController(classifier, config.budgets, config.max_queue, config.ticket_ttl_s,
                                     app.instance)
    endpoints = config.etcd_endpoint_list()
    members = Watcher(endpoints, config.etcd_prefix) if endpoints else None
    channels = ChannelPool(config.auth_token)

    replicas = ReplicaView(lambda: members.snapshot().values() if members is not None else (), config)
    servicer = AdmissionServicer(controller, classifier, config.queue_timeout_ms, replicas, channels)
    app.add_service(admission_pb2_grpc.add_AdmissionServiceServicer_to_server, servicer,
                    "k3.v1.AdmissionService")
    budgets: KeyWatcher | None = None

    async def start() -> None:
        nonlocal budgets
        loop = asyncio.get_running_loop()
        if endpoints:
            budgets = KeyWatcher(endpoints, config.etcd_prefix + config.budgets_key,
                                 lambda raw: loop.call_soon_threadsafe(controller.apply_budget_document, raw))
            await asyncio.to_thread(budgets.wait_synced, 10.0)
            await asyncio.to_thread(members.wait_synced, 10.0)

    async def stop() -> None:
        for watcher in (budgets, members):
            if watcher is not None:
                await asyncio.to_thread(watcher.close)
        await channels.close()

    app.on_start(start)
    app.every(SWEEP_S, controller.sweep_expired_tickets)
    app.on_stop(stop)
    app.run()
