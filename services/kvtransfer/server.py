"""`k3 serve kvtransfer`: the KV transfer service of one cluster."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from k3.v1 import kvtransfer_pb2_grpc
from services.kvtransfer.chunks import DEFAULT_MAX_CHUNK_BYTES
from services.kvtransfer.servicer import KVTransferServicer
from services.kvtransfer.store import HandleStore
from services.runtime import ServiceApp, ServiceConfig


@dataclasses.dataclass
class KVTransferConfig(ServiceConfig):
    port: int = 50053
    # Staging memory; a push that does not fit is refused with RESOURCE_EXHAUSTED and a retry hint.
    capacity_bytes: int = 2 << 30
    # Handles nobody released are dropped after this long.
    handle_ttl_s: float = 300.0
    # How long a pull waits for every producer rank to finish pushing.
    pull_wait_s: float = 30.0
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    retry_after_ms: int = 200

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes: must be > 0, got {self.capacity_bytes}")
        if not 0 < self.max_chunk_bytes <= self.max_message_bytes // 2:
            problems.append(f"max_chunk_bytes: must be in (0, max_message_bytes/2], got {self.max_chunk_bytes}")
        if self.handle_ttl_s <= 0 or self.pull_wait_s <= 0:
            problems.append("handle_ttl_s, pull_wait_s: must be > 0")
        return problems


def build(config: KVTransferConfig) -> tuple[ServiceApp, KVTransferServicer]:
    app = ServiceApp("kvtransfer", config)
    store = HandleStore(config.capacity_bytes, config.handle_ttl_s, config.retry_after_ms)
    servicer = KVTransferServicer(store, config.pull_wait_s, config.max_chunk_bytes)
    app.add_service(kvtransfer_pb2_grpc.add_KVTransferServiceServicer_to_server, servicer,
                    "k3.v1.KVTransferService")
    app.meta["capacity_bytes"] = config.capacity_bytes
    sweeper: list[asyncio.Task] = []

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(min(10.0, config.handle_ttl_s / 2))
            store.sweep()

    async def start() -> None:
        sweeper.append(asyncio.create_task(sweep_forever()))

    async def stop() -> None:
        for task in sweeper:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.on_start(start)
    app.on_stop(stop)
    return app, servicer


def main(argv: list[str]) -> None:
    app, _ = build(KVTransferConfig.load("kvtransfer", argv))
    app.run()
