"""The service bootstrap every K3 process runs: one grpc.aio server with health, reflection, metrics,
JSON logs, optional token auth, etcd membership, and a graceful drain on SIGTERM.

    app = ServiceApp("router", config)
    app.add_service(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, "k3.v1.RouterService")
    app.run()

Drain (SIGTERM or SIGINT): health turns NOT_SERVING and the etcd lease is revoked (routers stop sending),
new calls get UNAVAILABLE, in-flight calls get `drain_grace_s` to finish, the rest are cancelled, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.runtime.config import ServiceConfig
from services.runtime.interceptors import CallTracker, RuntimeInterceptor
from services.runtime.logs import setup_logging
from services.runtime.metrics import REGISTRY_CONNECTED, SERVICE_UP, serve_metrics
from services.runtime.registry import InstanceRecord, Registration

log = logging.getLogger("k3.app")

Hook = Callable[[], Awaitable[None]]


class ServiceApp:
    def __init__(self, name: str, config: ServiceConfig):
        self.name = name
        self.config = config
        self.instance = config.instance_name()
        self.tracker = CallTracker()
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.metrics_address = ""
        self.registration: Registration | None = None
        # Published in the etcd record and the ready file (e.g. a worker's TP layout, the gateway's HTTP address).
        self.meta: dict[str, Any] = {}
        self._services: list[tuple[Callable, Any, str]] = []
        self._on_start: list[Hook] = []
        self._on_stop: list[Hook] = []
        self._stopping = asyncio.Event()

    def add_service(self, add_to_server: Callable, servicer: Any, full_name: str) -> None:
        self._services.append((add_to_server, servicer, full_name))

    def on_start(self, hook: Hook) -> None:
        """Run after the server is listening, before it is marked SERVING (e.g. load a model)."""
        self._on_start.append(hook)

    def on_stop(self, hook: Hook) -> None:
        """Run after in-flight calls drained (e.g. flush state, stop background tasks)."""
        self._on_stop.append(hook)

    def every(self, interval_s: float, tick: Callable[[], None]) -> None:
        """Call `tick` on the event loop every `interval_s` while serving: from after the on_start hooks added
        before this call until the drain (it stops before the on_stop hooks added after it)."""
        task: asyncio.Task | None = None

        async def repeat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    tick()
                except Exception:  # noqa: BLE001 - one failed tick must not end all later ones
                    log.exception("periodic task failed", extra={"task": getattr(tick, "__qualname__", repr(tick))})

        async def start() -> None:
            nonlocal task
            task = asyncio.get_running_loop().create_task(repeat())

        async def stop() -> None:
            if task is not None:
                task.cancel()

        self.on_start(start)
        self.on_stop(stop)

    def run(self) -> None:
        setup_logging(self.name, self.instance, self.config.log_level)
        asyncio.run(self.serve())

    def request_stop(self) -> None:
        self._stopping.set()

    async def serve(self) -> None:
        cfg = self.config
        options = [
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(
            interceptors=[RuntimeInterceptor(self.name, self.tracker, cfg.auth_token)], options=options)
        names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        for add_to_server, servicer, full_name in self._services:
            add_to_server(servicer, server)
            names.append(full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(names, server)
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if port == 0:
            raise RuntimeError(f"cannot bind {cfg.host}:{cfg.port}")
        self.address = cfg.advertise_address or f"{cfg.host}:{port}"
        await self._set_serving(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if cfg.metrics_port >= 0:
            self.metrics_address = f"{cfg.host}:{serve_metrics(cfg.host, cfg.metrics_port)}"

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        for hook in self._on_start:
            await hook()
        self._register()
        await self._set_serving(health_pb2.HealthCheckResponse.SERVING)
        SERVICE_UP.labels(self.name, self.instance, cfg.cluster).set(1)
        self._write_ready_file()
        log.info("serving", extra={"address": self.address, "metrics": self.metrics_address})

        await self._stopping.wait()
        await self._drain(server)

    async def _drain(self, server: grpc.aio.Server) -> None:
        started = time.monotonic()
        log.info("draining", extra={"in_flight": self.tracker.active, "grace_s": self.config.drain_grace_s})
        self.tracker.draining = True
        SERVICE_UP.labels(self.name, self.instance, self.config.cluster).set(0)
        await self._set_serving(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.registration is not None:
            await asyncio.to_thread(self.registration.close)
        finished = await self.tracker.wait_idle(self.config.drain_grace_s)
        if not finished:
            log.warning("grace period over; cancelling calls", extra={"in_flight": self.tracker.active})
        await server.stop(grace=0.5)
        for hook in self._on_stop:
            await hook()
        log.info("stopped", extra={"drain_s": round(time.monotonic() - started, 3)})

    async def _set_serving(self, status: int) -> None:
        await self.health.set("", status)
        for _, _, full_name in self._services:
            await self.health.set(full_name, status)

    def _register(self) -> None:
        endpoints = self.config.etcd_endpoint_list()
        if not endpoints:
            return
        record = InstanceRecord(
            service=self.name, cluster=self.config.cluster, instance=self.instance, address=self.address,
            region=self.config.region, started=time.time(),
            meta={"metrics": self.metrics_address, "pid": os.getpid(), **self.meta})
        gauge = REGISTRY_CONNECTED.labels(self.name)
        self.registration = Registration(endpoints, self.config.etcd_prefix, record, self.config.lease_ttl_s,
                                         on_state=lambda up: gauge.set(1 if up else 0))

    def _write_ready_file(self) -> None:
        if not self.config.ready_file:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.meta, "address": self.address, "metrics_address": self.metrics_address,
                                   "pid": os.getpid(), "service": self.name, "instance": self.instance}))
        tmp.replace(path)
