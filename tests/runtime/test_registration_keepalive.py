"""A registration's lease keepalive against a real etcd: refreshes that fail while the lease still has time
left (injected: the real client's refresh raises, as a slow or briefly unreachable etcd makes it) are
retried on the same lease, so the record never leaves the membership and is not re-registered under a new
lease; the failover tests' "a killed member leaves within TTL + 1 s" is tested in test_service_runtime.py."""

from __future__ import annotations

import threading
import time

from services.runtime import registry
from services.runtime.registry import InstanceRecord, Registration, Watcher
from tests.runtime.test_service_runtime import wait_until


def test_failed_refreshes_are_retried_on_the_live_lease(etcd_server):
    prefix = "/k3-keepalive-test"
    record = InstanceRecord("svc", "c9", "flaky", "127.0.0.1:1")
    registration = Registration([etcd_server], prefix, record, ttl_s=2)
    seen: list[bool] = []  # per membership change: is the record there?
    watcher = Watcher([etcd_server], prefix, on_change=lambda snapshot: seen.append(record.key(prefix) in snapshot))
    try:
        assert wait_until(lambda: seen and seen[-1] and registration._lease is not None, 10)
        lease = registration._lease.id
        client = registration._client
        real_refresh, failures = client.refresh_lease, [3]
        lock = threading.Lock()

        def flaky_refresh(lease_id):  # INJECTED fault: the next 3 refreshes fail before reaching etcd
            with lock:
                if failures[0]:
                    failures[0] -= 1
                    raise ConnectionError("injected: etcd did not answer in time")
            return real_refresh(lease_id)
        client.refresh_lease = flaky_refresh
        assert wait_until(lambda: failures[0] == 0, 5)
        time.sleep(2.5)  # past the TTL: the lease lives only if a retry refreshed it
        assert registration._lease.id == lease and registration._client is client  # never re-registered
        assert watcher.snapshot().get(record.key(prefix)) == record and all(seen[seen.index(True):])
    finally:
        watcher.close()
        registration.close()


def test_failed_refreshes_are_not_retried_past_the_leases_deadline(etcd_server, monkeypatch):
    """The retries stop at a lower bound of the lease's deadline, counted from the grant request: a slow
    `on_state` (or put) between the grant and the first refresh must not stretch them onto a lease etcd has
    already expired (the member would stay out of the membership that much longer before registering afresh)."""
    granted: list[float] = []  # when each lease was asked for
    attempts: list[float] = []  # when each refresh was tried
    real_connect = registry.connect

    def connect(endpoints):  # the real client; its refreshes fail (INJECTED), its grants are timed
        client = real_connect(endpoints)
        real_lease = client.lease

        def lease(ttl):
            granted.append(time.monotonic())
            return real_lease(ttl)

        def refresh_lease(lease_id):
            attempts.append(time.monotonic())
            raise ConnectionError("injected: etcd did not answer in time")
        client.lease, client.refresh_lease = lease, refresh_lease
        return client
    monkeypatch.setattr(registry, "connect", connect)
    slow = [True]

    def on_state(up: bool) -> None:  # the first registration's callback takes 1.5 s of the 2 s TTL
        if up and slow[0]:
            slow[0] = False
            time.sleep(1.5)
    record = InstanceRecord("svc", "c9", "slow-callback", "127.0.0.1:1")
    registration = Registration([etcd_server], "/k3-keepalive-deadline", record, ttl_s=2, on_state=on_state)
    try:
        assert wait_until(lambda: len(granted) >= 2, 15)  # gave the first lease up and registered afresh
        on_first = [t for t in attempts if t < granted[1]]
        # past the deadline: at most one retry wait (0.1 s) and a late wake-up; before the fix: 1.5 s and more
        assert on_first and max(on_first) < granted[0] + 2 + 0.8
    finally:
        registration.close()


def test_a_lease_granted_while_closing_is_revoked(etcd_server, monkeypatch):
    """`close()` racing a (re-)registration: the thread was connecting when `close()` revoked the lease it
    knew of (none), then granted a new one and put the record. The thread revokes what it holds on its way
    out, so the record leaves at once instead of one TTL later."""
    real_connect = registry.connect
    registration: list[Registration] = []
    puts: list[str] = []  # the records the thread put (the race happened: the record was there to remove)

    def connect(endpoints):  # the real client, handed over only once close() has begun
        assert wait_until(lambda: registration and registration[0]._stop.is_set(), 10)
        time.sleep(0.2)  # close() has revoked (nothing) and is joining the thread
        client = real_connect(endpoints)
        real_put = client.put
        client.put = lambda key, value, **kwargs: (puts.append(key), real_put(key, value, **kwargs))[1]
        return client
    monkeypatch.setattr(registry, "connect", connect)
    prefix, record = "/k3-keepalive-close", InstanceRecord("svc", "c9", "closing", "127.0.0.1:1")
    registration.append(Registration([etcd_server], prefix, record, ttl_s=10))
    registration[0].close()
    assert puts == [record.key(prefix)]
    client = real_connect([etcd_server])
    try:  # gone well inside the lease's 10 s TTL (before the fix it stayed for all of it)
        assert wait_until(lambda: client.get(record.key(prefix))[0] is None, 5)
    finally:
        client.close()
