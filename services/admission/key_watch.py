"""Follow one etcd key: call `on_value(bytes | None)` with its value now and after every change.

Used for live budgets. On an etcd outage it keeps the last value (admission goes on with the budgets it
had) and re-reads the key when etcd returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pyetcd

from services.runtime.registry import connect

log = logging.getLogger("k3.admission.watch")


class KeyWatcher:
    def __init__(self, endpoints: list[str], key: str, on_value: Callable[[bytes | None], None]):
        self.endpoints, self.key, self.on_value = endpoints, key, on_value
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._cancel: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-key-{key}", daemon=True)
        self._thread.start()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                client = connect(self.endpoints)
                response = client.get_response(self.key)
                self.on_value(response.kvs[0].value if response.kvs else None)
                self._synced.set()
                events, self._cancel = client.watch(self.key, start_revision=response.header.revision + 1)
                for event in events:
                    if self._stop.is_set():
                        break
                    self.on_value(None if isinstance(event, pyetcd.events.DeleteEvent) else event.value)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep the last value, retry
                if not self._stop.is_set():
                    log.error("etcd key watch lost; keeping the last value", extra={"key": self.key,
                                                                                    "error": str(exc)})
            self._stop.wait(0.5)

    def close(self) -> None:
        self._stop.set()
        if self._cancel is not None:
            try:
                self._cancel()
            except Exception:  # noqa: BLE001
                pass
        self._thread.join(timeout=2)
