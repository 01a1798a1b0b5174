"""What the control plane says during a drill: the router's view of cluster health (polled, to time the
detection of a fault) and each session's pre-assigned (primary, backup) before the fault."""

from __future__ import annotations

import asyncio
import time

import grpc

from k3.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.runtime.client import aio_channel


class FleetObserver:
    """Records when the router stops counting `cluster` as healthy (and when it counts it again)."""

    def __init__(self, router_address: str, token: str = "", interval_s: float = 0.05):
        self.router_address, self.token, self.interval_s = router_address, token, interval_s
        self.history: list[tuple[float, dict[str, bool]]] = []

    async def healthy(self, stub) -> dict[str, bool]:
        reply = await stub.GetFleet(router_pb2.GetFleetRequest(), timeout=1)
        return {c.cluster.name: c.healthy for c in reply.clusters}

    async def watch(self, t0: float, stop: asyncio.Event) -> None:
        async with aio_channel(self.router_address, self.token) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            while not stop.is_set():
                try:
                    self.history.append((time.monotonic() - t0, await self.healthy(stub)))
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(self.interval_s)

    def first_unhealthy(self, cluster: str, after: float) -> float | None:
        for t, view in self.history:
            if t >= after and not view.get(cluster, False):
                return t
        return None

    def unhealthy_seconds(self, after: float) -> dict[str, float]:
        """Per cluster, how long the router counted it unhealthy after `after` (sampled every interval)."""
        spans: dict[str, float] = {}
        samples = [(t, view) for t, view in self.history if t >= after]
        for (t, view), (t_next, _) in zip(samples, samples[1:], strict=False):
            for cluster, healthy in view.items():
                spans[cluster] = spans.get(cluster, 0.0) + (0.0 if healthy else t_next - t)
        return {c: round(v, 2) for c, v in sorted(spans.items())}

    def min_healthy(self, after: float) -> int | None:
        """The fewest clusters the router counted healthy at once after `after`."""
        counts = [sum(view.values()) for t, view in self.history if t >= after]
        return min(counts) if counts else None

    async def placements(self, sessions: list[str], parallel: int = 32) -> dict[str, tuple[str, str]]:
        """session -> (primary, backup) as the router assigns them now (ask before injecting the fault)."""
        gate = asyncio.Semaphore(parallel)
        async with aio_channel(self.router_address, self.token) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)

            async def one(session: str) -> tuple[str, tuple[str, str]]:
                async with gate:
                    reply = await stub.Route(router_pb2.RouteRequest(
                        session=common_pb2.SessionRef(session_id=session)), timeout=10)
                return session, (reply.primary.name, reply.backup.name)

            return dict(await asyncio.gather(*(one(s) for s in sessions)))
