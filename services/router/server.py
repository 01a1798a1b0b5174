"""The session router process: `k3 serve router [--flags]`."""

from __future__ import annotations

import asyncio

import grpc

from k3.v1 import router_pb2_grpc
from services.router.config import RouterConfig
from services.router.service import RouterServicer
from services.runtime import ServiceApp
from services.runtime.client import aio_channel
from services.runtime.registry import Watcher

TICK_S = 1.0


def main(argv: list[str]) -> None:
    config = RouterConfig.load("router", argv)
    app = ServiceApp("router", config)
    channels: dict[str, grpc.aio.Channel] = {}

    def channel_for(address: str) -> grpc.aio.Channel:
        if address not in channels:
            channels[address] = aio_channel(address, config.auth_token)
        return channels[address]

    servicer = RouterServicer(config, channel_for)
    app.add_service(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, "k3.v1.RouterService")
    watcher: Watcher | None = None
    ticker: asyncio.Task | None = None

    async def start() -> None:
        nonlocal watcher, ticker
        loop = asyncio.get_running_loop()
        endpoints = config.etcd_endpoint_list()
        if not endpoints:
            raise SystemExit("router: etcd_endpoints is required (membership comes from etcd)")
        # The watcher calls back on its own thread; membership is only ever touched on the loop.
        watcher = Watcher(endpoints, config.etcd_prefix,
                          lambda snapshot: loop.call_soon_threadsafe(servicer.apply_membership, snapshot.values()))
        await asyncio.to_thread(watcher.wait_synced, 10.0)
        await servicer.wait_ready()
        ticker = loop.create_task(tick_forever())

    async def tick_forever() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            servicer.tick()

    async def stop() -> None:
        if ticker is not None:
            ticker.cancel()
        if watcher is not None:
            await asyncio.to_thread(watcher.close)
        for channel in channels.values():
            await channel.close()

    app.on_start(start)
    app.on_stop(stop)
    app.run()
