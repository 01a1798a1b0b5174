"""The session router process: `k3 serve router [--flags]`."""

from __future__ import annotations

import asyncio
import threading

from k3.v1 import router_pb2_grpc
from services.router.assignment_store import AssignmentStore
from services.router.config import RouterConfig
from services.router.service import RouterServicer
from services.runtime import ServiceApp
from services.runtime.client import ChannelPool
from services.runtime.registry import Watcher

TICK_S = 1.0


def main(argv: list[str]) -> None:
    config = RouterConfig.load("router", argv)
    app = ServiceApp("router", config)
    channels = ChannelPool(config.auth_token)
    assignments: AssignmentStore | None = None
    if config.placement_mode == "bounded":
        if not config.etcd_endpoint_list():
            raise SystemExit("router: placement_mode bounded stores assignments in etcd; set etcd_endpoints")
        assignments = AssignmentStore(config.etcd_endpoint_list(), config.etcd_prefix, config.bounded_eps,
                                      config.session_idle_ttl_s, config.assignment_lease_window_s)
    servicer = RouterServicer(config, channels, assignments=assignments)
    app.add_service(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, "k3.v1.RouterService")
    watcher: Watcher | None = None

    async def start() -> None:
        nonlocal watcher
        loop = asyncio.get_running_loop()
        endpoints = config.etcd_endpoint_list()
        if not endpoints:
            raise SystemExit("router: etcd_endpoints is required (membership comes from etcd)")
        # The watcher calls back on its own thread; membership is only ever touched on the loop. Snapshots
        # are coalesced (the loop applies the newest), so a burst of expiries that the watcher has already
        # folded lands as one change: the damping then sees a mass loss at once, not a cascade.
        latest: dict[str, dict] = {}
        lock = threading.Lock()

        def apply_latest() -> None:
            with lock:
                snapshot = latest.pop("snapshot")
            servicer.apply_membership(snapshot.values())

        def on_change(snapshot: dict) -> None:
            with lock:
                scheduled = "snapshot" in latest
                latest["snapshot"] = snapshot
            if not scheduled:
                loop.call_soon_threadsafe(apply_latest)

        watcher = Watcher(endpoints, config.etcd_prefix, on_change)
        await asyncio.to_thread(watcher.wait_synced, 10.0)
        if assignments is not None:
            await asyncio.to_thread(assignments.wait_synced, 10.0)
        await servicer.wait_ready()

    async def stop() -> None:
        if watcher is not None:
            await asyncio.to_thread(watcher.close)
        if assignments is not None:
            await asyncio.to_thread(assignments.close)
        await channels.close()

    app.on_start(start)
    app.every(TICK_S, servicer.tick)
    app.on_stop(stop)
    app.run()
