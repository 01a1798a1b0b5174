"""Fleet membership in etcd: instances register under a lease and peers watch the prefix.

Keys: `<prefix>/instances/<cluster>/<service>/<instance>` -> JSON `InstanceRecord`. A registration lives as
long as its lease; a killed process stops refreshing and etcd deletes the key within the TTL. When etcd is
unreachable, registrations retry and watchers keep serving the last known membership (and say so loudly);
when it returns, instances re-register and watchers re-list.

The etcd client (pyetcd, the etcd3 API) is synchronous, so each registration and watch runs in a thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

import pyetcd

from services.runtime.etcd_follow import EtcdFollower, connect

log = logging.getLogger("k3.registry")


@dataclasses.dataclass(frozen=True)
class InstanceRecord:
    service: str
    cluster: str
    instance: str
    address: str
    region: str = ""
    started: float = 0.0
    meta: dict = dataclasses.field(default_factory=dict)

    def key(self, prefix: str) -> str:
        return f"{prefix}/instances/{self.cluster}/{self.service}/{self.instance}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: bytes | str) -> InstanceRecord:
        return cls(**json.loads(text))


class Registration:
    """Keeps one instance record alive in etcd until `close()`; survives etcd outages."""

    def __init__(self, endpoints: list[str], prefix: str, record: InstanceRecord, ttl_s: float,
                 on_state: Callable[[bool], None] | None = None):
        self.endpoints, self.prefix, self.record = endpoints, prefix, record
        self.ttl = max(1, int(round(ttl_s)))
        self.on_state = on_state or (lambda up: None)
        self._stop = threading.Event()
        self._lease = None
        self._client = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-register-{record.service}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client = connect(self.endpoints)
                requested = time.monotonic()  # etcd grants after this: the lease lives at least until + TTL
                self._lease = self._client.lease(self.ttl)
                self._client.put(self.record.key(self.prefix), self.record.to_json(), lease=self._lease)
                log.info("registered in etcd", extra={"key": self.record.key(self.prefix), "ttl_s": self.ttl})
                self.on_state(True)
                self._keepalive(requested)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep serving, retry
                log.error("etcd registration lost; serving on, retrying", extra={"error": str(exc)})
                if self._client is not None:  # each retry connects afresh; do not leak the dead client
                    self._client.close()
                    self._client = None
            self.on_state(False)
            self._stop.wait(min(1.0, self.ttl / 3))
        self._revoke()  # a lease granted while `close()` ran (it revoked the one before) must not linger
        if self._client is not None:
            self._client.close()

    def _revoke(self) -> None:
        if self._lease is not None:
            try:
                self._lease.revoke()
            except Exception:  # noqa: BLE001 - etcd gone or already revoked: the lease expires by itself
                pass

    def _keepalive(self, requested: float) -> None:
        """Refresh every TTL/5 (etcd's own clients use TTL/3): a process starved by a loaded machine keeps
        its lease through a stall of up to 4/5 of the TTL (was 2/3: at TTL 2 s, 1.6 s instead of 1.33 s). A
        refresh that fails while the lease has time left is retried on the same lease every 0.1 s (a slow
        or briefly unreachable etcd no longer tears down a live registration); an expired lease, or no
        successful refresh before it runs out, raises and the caller registers afresh. A killed process
        refreshes nothing: its lease still ends one TTL after its last refresh."""
        period = self.ttl / 5
        # a lower bound of the lease's deadline: counted from the grant request, not from now (the put and
        # `on_state` ran since), so no failed refresh is retried on a lease etcd may already have expired
        alive_until = requested + self.ttl
        wait = period
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                responses = list(self._client.refresh_lease(self._lease.id))
            except Exception as exc:  # noqa: BLE001 - retried while the lease lives, else re-registered
                if time.monotonic() >= alive_until:
                    raise
                log.warning("etcd lease refresh failed; retrying on the same lease", extra={"error": str(exc)})
                wait = min(0.1, period)
                continue
            if not responses or responses[0].TTL <= 0:
                raise ConnectionError("lease expired")
            alive_until, wait = sent + responses[0].TTL, period

    def close(self) -> None:
        """Stop refreshing and revoke the lease, so peers see this instance leave at once."""
        self._stop.set()
        self._revoke()  # at once, even if the thread is stuck in a call to etcd
        # the thread closes its client on its way out; one still in a call to etcd after this keeps it until then
        self._thread.join(timeout=2)


class Watcher(EtcdFollower):
    """Mirrors every record under `<prefix>/instances/` into memory and calls `on_change(snapshot)`."""

    def __init__(self, endpoints: list[str], prefix: str,
                 on_change: Callable[[dict[str, InstanceRecord]], None] | None = None):
        super().__init__(endpoints, "etcd-watch")
        self.watch_prefix = f"{prefix}/instances/"
        self.on_change = on_change or (lambda snapshot: None)
        self._snapshot: dict[str, InstanceRecord] = {}
        self._lock = threading.Lock()
        self._start()

    def snapshot(self) -> dict[str, InstanceRecord]:
        with self._lock:
            return dict(self._snapshot)

    def _publish(self, snapshot: dict[str, InstanceRecord]) -> None:
        with self._lock:
            self._snapshot = snapshot
        try:
            self.on_change(dict(snapshot))
        except Exception:  # noqa: BLE001 - a bad callback must not kill the watch
            log.exception("membership callback failed")

    def _follow(self, client: pyetcd.client) -> None:
        response = client.get_prefix_response(self.watch_prefix)
        self._publish({kv.key.decode(): InstanceRecord.from_json(kv.value) for kv in response.kvs})
        self._mark_synced()
        for event in self._watch(client.watch_prefix, self.watch_prefix,
                                 start_revision=response.header.revision + 1):
            snapshot = self.snapshot()
            key = event.key.decode()
            if isinstance(event, pyetcd.events.DeleteEvent):
                snapshot.pop(key, None)
            else:
                snapshot[key] = InstanceRecord.from_json(event.value)
            self._publish(snapshot)

    def _lost(self, exc: Exception) -> None:
        log.error("etcd watch lost; serving last known membership",
                  extra={"error": str(exc), "instances": len(self.snapshot())})
