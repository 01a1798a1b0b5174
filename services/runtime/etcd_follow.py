"""A thread that reads part of etcd, then follows its changes, and survives etcd outages.

Subclasses implement `_follow(client)`: read the current state, call `_mark_synced()`, then consume a watch
stream started with `_watch(...)`. When etcd goes away the last state is kept (callers serve on with it), the
failure is logged once per outage, and the thread reconnects and re-reads when etcd returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pyetcd

log = logging.getLogger("k3.etcd")


def connect(endpoints: list[str], timeout: float = 2.0) -> pyetcd.client:
    """A client for the first endpoint that answers."""
    last: Exception | None = None
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        client = pyetcd.client(host=host, port=int(port), timeout=timeout)
        try:
            client.status()
            return client
        except Exception as exc:  # noqa: BLE001 - try the next endpoint
            last = exc
            client.close()
    raise ConnectionError(f"no etcd endpoint answered ({', '.join(endpoints)}): {last}")


class EtcdFollower:
    def __init__(self, endpoints: list[str], thread_name: str):
        self.endpoints = endpoints
        self.connected = False
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._cancel: Callable[[], None] | None = None
        self._cancel_lock = threading.Lock()  # close() may run while the thread is just starting its watch
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        """Called by subclasses once their own state exists (the thread reads it at once)."""
        self._thread.start()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def _follow(self, client: pyetcd.client) -> None:
        raise NotImplementedError

    def _lost(self, exc: Exception) -> None:
        """Log an outage; the last state is kept."""
        log.error("etcd watch lost; keeping the last state", extra={"error": str(exc)})

    def _mark_synced(self) -> None:
        self.connected = True
        self._synced.set()

    def _watch(self, start: Callable[..., tuple[Iterator, Callable[[], None]]], *args, **kwargs) -> Iterator:
        """Start a watch (client.watch or client.watch_prefix) and yield its events until close()."""
        events, cancel = start(*args, **kwargs)
        with self._cancel_lock:
            self._cancel = cancel
            stopping = self._stop.is_set()
        if stopping:  # close() ran before the watch existed: it had nothing to cancel
            cancel()
            return
        for event in events:
            if self._stop.is_set():
                return
            yield event

    def _run(self) -> None:
        while not self._stop.is_set():
            client = None
            try:
                client = connect(self.endpoints)
                self._follow(client)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep the last state, retry
                if not self._stop.is_set():
                    self._lost(exc)
            finally:
                if client is not None:
                    client.close()
            self.connected = False
            self._stop.wait(0.5)

    def close(self) -> None:
        with self._cancel_lock:
            self._stop.set()
            cancel = self._cancel
        if cancel is not None:
            try:
                cancel()
            except Exception:  # noqa: BLE001 - the stream is going away either way
                pass
        self._thread.join(timeout=2)
