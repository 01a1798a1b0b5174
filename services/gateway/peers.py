"""Where the gateway's peers are: discovered from etcd membership, or given statically."""

from __future__ import annotations

import itertools

import grpc

from services.runtime.client import ChannelPool
from services.runtime.registry import Watcher


class Peers:
    def __init__(self, watcher: Watcher | None, static: dict[str, str], token: str = ""):
        self.watcher = watcher
        self.static = {k: v for k, v in static.items() if v}
        self._channels = ChannelPool(token)
        self._turn = itertools.count()

    def addresses(self, service: str) -> list[str]:
        if service in self.static:
            return [self.static[service]]
        if self.watcher is None:
            return []
        return sorted(r.address for r in self.watcher.snapshot().values() if r.service == service)

    def pick(self, service: str) -> str | None:
        """Round-robin over the replicas of a control-plane service (they agree: state lives in etcd)."""
        found = self.addresses(service)
        return found[next(self._turn) % len(found)] if found else None

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels(address)

    async def close(self) -> None:
        await self._channels.close()
        if self.watcher is not None:
            self.watcher.close()
