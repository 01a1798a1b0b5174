"""Bounded-mode session assignments in etcd, shared by every router replica and mirrored in memory.

Keys under `<prefix>/assign/`:
- `s/<session id>` -> {"p": primary, "b": backup}, on a lease, so it expires once the session idles;
- `seq/<primary>` -> "", rewritten by every assignment of a session with that primary: its mod revision
  serialises the assignments of one primary across replicas.
A new session is created by one transaction: `version(s/<id>) == 0 and mod(seq/<primary>) == <revision this
replica's mirror has reached>` -> put both. When it fails, either the session now exists (a replica raced
us on it: everyone takes the stored pair) or another session of the same primary was assigned meanwhile:
wait until the mirror has applied it, recount, retry. So every assignment is checked against the counts of
all earlier ones of its primary, and the pair cap holds across replicas, not only within one.
Reads: a watch mirrors the prefix into a dict; routing a known session is a dict lookup, no etcd call.
Expiry: a replica puts all assignments of one `window_s` window on one lease with TTL idle_ttl + window_s
(a lease per window, not per session). Routing a known session whose lease has less than idle_ttl left
re-puts it on the current lease (background thread; at most once per window per active session), so a
session's assignment outlives its last route by idle_ttl to idle_ttl + window_s.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pyetcd
from prometheus_client import Counter

from services.router.assignment_records import LeaseWindows, Stored, create_ops, decode, encode, refresh_ops
from services.router.bounded import Assignment, PairLoads, choose_backup
from services.runtime.etcd_follow import EtcdFollower, connect

log = logging.getLogger("k3.router.assignments")
ASSIGNMENTS = Counter("k3_router_assignments_total", "Bounded-mode session assignments", ["outcome"])
# Keys read per request of the initial load (etcd answers are bounded by gRPC's message size).
PAGE = 2000


class AssignmentStore(EtcdFollower):
    def __init__(self, endpoints: list[str], prefix: str, eps: float, idle_ttl_s: float, window_s: float):
        super().__init__(endpoints, "etcd-assignments")
        self.root = f"{prefix}/assign/"
        self.eps = eps
        self.idle_ttl_s = idle_ttl_s
        self.loads = PairLoads()
        self._sessions: dict[str, Stored] = {}
        self._seq: dict[str, int] = {}
        # Lease id -> time.monotonic() at which it expires (learned from etcd for other replicas' leases).
        self._lease_deadline: dict[int, float] = {}
        self._cond = threading.Condition()
        self._primary_locks: dict[str, threading.Lock] = {}
        self._leases = LeaseWindows(idle_ttl_s, window_s)
        self._writer: pyetcd.client | None = None
        self._writer_lock = threading.Lock()
        self._refreshing: set[str] = set()
        self._refresh_queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._refresher = threading.Thread(target=self._refresh_loop, name="assignment-refresh", daemon=True)
        self._start()
        self._refresher.start()

    def session_key(self, session_id: str) -> str:
        return f"{self.root}s/{session_id}"

    def seq_key(self, primary: str) -> str:
        return f"{self.root}seq/{primary}"

    # ---- reads (any thread; the event loop's hot path) ----
    def get(self, session_id: str) -> Assignment | None:
        stored = self._sessions.get(session_id)
        return stored.assignment if stored is not None else None

    def __len__(self) -> int:
        return len(self._sessions)

    def touch(self, session_id: str) -> None:
        """Note a route of a known session: re-lease it when its lease has less than idle_ttl left."""
        stored = self._sessions.get(session_id)
        if stored is None or session_id in self._refreshing:
            return
        deadline = self._lease_deadline.get(stored.lease)
        if deadline is not None and deadline - time.monotonic() < self.idle_ttl_s:
            self._refreshing.add(session_id)
            self._refresh_queue.put(session_id)

    # ---- writes (blocking: call from a worker thread) ----
    def assign(self, session_id: str, order: Sequence[str], weights: Mapping[str, float],
               healthy: Collection[str], timeout_s: float = 2.0) -> Assignment:
        """The session's stored pair, creating it (bounded backup, see bounded.py) if it has none."""
        deadline = time.monotonic() + timeout_s
        # This replica's own assignments of one primary go one at a time: concurrent ones would only make
        # each other's transactions fail on the sequence key and retry.
        local = self._primary_locks.setdefault(order[0], threading.Lock())
        if not local.acquire(timeout=timeout_s):
            raise TimeoutError(f"assignment of {session_id!r}: this replica's queue for {order[0]!r} is stuck")
        try:
            return self._assign(session_id, order, weights, healthy, deadline)
        finally:
            local.release()

    def _assign(self, session_id: str, order: Sequence[str], weights: Mapping[str, float],
                healthy: Collection[str], deadline: float) -> Assignment:
        primary, key, seq_key = order[0], self.session_key(session_id), self.seq_key(order[0])
        while True:
            with self._cond:
                if (stored := self._sessions.get(session_id)) is not None:
                    return stored.assignment
                candidate = Assignment(primary, choose_backup(order, self.loads, weights, self.eps, healthy))
                seen = self._seq.get(primary, 0)
            ok, responses = self._txn(functools.partial(create_ops, key, seq_key, encode(candidate), seen))
            if ok:
                meta = responses[2][0][1]
                self._apply_put(session_id, candidate, meta.mod_revision, meta.lease_id)
                self._apply_seq(primary, meta.mod_revision)
                ASSIGNMENTS.labels("created").inc()
                return candidate
            if responses[0]:  # another replica created this session first: its pair is the pair
                existing_value, meta = responses[0][0]
                existing = decode(existing_value)
                self._apply_put(session_id, existing, meta.mod_revision, meta.lease_id)
                ASSIGNMENTS.labels("raced").inc()
                return existing
            needed = responses[1][0][1].mod_revision
            ASSIGNMENTS.labels("retried").inc()
            with self._cond:
                if not self._cond.wait_for(lambda n=needed: self._seq.get(primary, 0) >= n,
                                           max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"assignment of {session_id!r}: the etcd watch did not catch up")

    def _client(self) -> pyetcd.client:
        with self._writer_lock:
            if self._writer is None:
                self._writer = connect(self.endpoints)
            return self._writer

    def _txn(self, ops: Callable[[Any, int], tuple[list, list, list]]) -> tuple[bool, list]:
        """Run the transaction `ops(transactions, lease)` builds on the current lease; once more on a fresh
        lease and connection if it fails (the lease may have expired under us, or etcd restarted)."""
        for attempt in range(2):
            try:
                client = self._client()
                compare, success, failure = ops(client.transactions, self._leases.current(client, self._lease_deadline))
                return client.transaction(compare=compare, success=success, failure=failure)
            except Exception:
                if attempt:
                    raise
                self._leases.drop()
                with self._writer_lock:
                    if self._writer is not None:
                        self._writer.close()
                    self._writer = None
        raise AssertionError("unreachable")

    def _refresh_loop(self) -> None:
        while (session_id := self._refresh_queue.get()) is not None:
            try:
                self._refresh(session_id)
            except Exception as exc:  # noqa: BLE001 - a later route asks again
                log.warning("assignment lease refresh failed", extra={"session": session_id, "error": str(exc)})
            finally:
                self._refreshing.discard(session_id)

    def _refresh(self, session_id: str) -> None:
        stored = self._sessions.get(session_id)
        if stored is None:
            return
        ok, responses = self._txn(functools.partial(refresh_ops, self.session_key(session_id),
                                                    encode(stored.assignment), stored.mod_revision))
        if ok:
            meta = responses[1][0][1]
            self._apply_put(session_id, stored.assignment, meta.mod_revision, meta.lease_id)

    # ---- the mirror (watch thread, and local writes) ----
    def _apply_put(self, session_id: str, assignment: Assignment, mod_revision: int, lease: int) -> None:
        with self._cond:
            old = self._sessions.get(session_id)
            if old is not None and old.mod_revision >= mod_revision:
                return
            if old is not None:
                self.loads.remove(old.assignment)
            self.loads.add(assignment)
            self._sessions[session_id] = Stored(assignment, mod_revision, lease)
            self._cond.notify_all()

    def _apply_delete(self, session_id: str, mod_revision: int) -> None:
        with self._cond:
            old = self._sessions.get(session_id)
            if old is not None and old.mod_revision < mod_revision:
                del self._sessions[session_id]
                self.loads.remove(old.assignment)

    def _apply_seq(self, primary: str, mod_revision: int) -> None:
        with self._cond:
            self._seq[primary] = max(self._seq.get(primary, 0), mod_revision)
            self._cond.notify_all()

    @staticmethod
    def _decode(key: bytes, value: bytes) -> Assignment | None:
        try:
            return decode(value)
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed assignment", extra={"key": key.decode(errors="replace")})
            return None

    def _learn_lease(self, client: pyetcd.client, lease: int) -> None:
        if lease and lease not in self._lease_deadline:
            self._lease_deadline[lease] = time.monotonic() + client.get_lease_info(lease).TTL

    def _apply_event(self, client: pyetcd.client, key: str, event) -> None:
        kind, _, name = key[len(self.root):].partition("/")
        deleted = isinstance(event, pyetcd.events.DeleteEvent)
        if kind == "seq" and not deleted:
            self._apply_seq(name, event.mod_revision)
        elif kind == "s" and deleted:
            self._apply_delete(name, event.mod_revision)
        elif kind == "s":
            if (assignment := self._decode(event.key, event.value)) is None:
                return
            self._learn_lease(client, event.lease)
            self._apply_put(name, assignment, event.mod_revision, event.lease)

    def _load(self, client: pyetcd.client, kvs: list) -> None:
        """Replace the mirror with a full read (at start and after an outage): built aside, then swapped, so
        routes never see a half-filled table."""
        sessions: dict[str, Stored] = {}
        seq: dict[str, int] = {}
        loads = PairLoads()
        for kv in kvs:
            kind, _, name = kv.key.decode()[len(self.root):].partition("/")
            if kind == "seq":
                seq[name] = kv.mod_revision
            elif kind == "s" and (assignment := self._decode(kv.key, kv.value)) is not None:
                self._learn_lease(client, kv.lease)
                sessions[name] = Stored(assignment, kv.mod_revision, kv.lease)
                loads.add(assignment)
        with self._cond:
            self._sessions, self._seq, self.loads = sessions, seq, loads
            self._cond.notify_all()

    def _follow(self, client: pyetcd.client) -> None:
        end = pyetcd.utils.prefix_range_end(self.root.encode())
        first = client.get_range_response(self.root, end, limit=PAGE)
        revision, kvs, response = first.header.revision, list(first.kvs), first
        while response.more:
            response = client.get_range_response(kvs[-1].key + b"\0", end, limit=PAGE, revision=revision)
            kvs.extend(response.kvs)
        self._load(client, kvs)
        self._mark_synced()
        log.info("assignment mirror loaded", extra={"sessions": len(self._sessions), "revision": revision})
        for event in self._watch(client.watch_prefix, self.root, start_revision=revision + 1):
            self._apply_event(client, event.key.decode(), event)

    def close(self) -> None:
        self._refresh_queue.put(None)
        super().close()
        self._refresher.join(timeout=2)
        with self._writer_lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
