"""Follow one etcd key: call `on_value(bytes | None)` with its value now and after every change.

Used for live budgets. On an etcd outage it keeps the last value (admission goes on with the budgets it
had) and re-reads the key when etcd returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyetcd

from services.runtime.etcd_follow import EtcdFollower

log = logging.getLogger("k3.admission.watch")


class KeyWatcher(EtcdFollower):
    def __init__(self, endpoints: list[str], key: str, on_value: Callable[[bytes | None], None]):
        super().__init__(endpoints, f"etcd-key-{key}")
        self.key, self.on_value = key, on_value
        self._start()

    def _follow(self, client: pyetcd.client) -> None:
        response = client.get_response(self.key)
        self.on_value(response.kvs[0].value if response.kvs else None)
        self._mark_synced()
        for event in self._watch(client.watch, self.key, start_revision=response.header.revision + 1):
            self.on_value(None if isinstance(event, pyetcd.events.DeleteEvent) else event.value)

    def _lost(self, exc: Exception) -> None:
        log.error("etcd key watch lost; keeping the last value", extra={"key": self.key, "error": str(exc)})
