"""The etcd side of bounded-mode assignments: the record format, the two transactions, the lease windows.

See assignment_store.py for how they are used.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyetcd

from services.router.bounded import Assignment


@dataclass(frozen=True)
class Stored:
    assignment: Assignment
    mod_revision: int
    lease: int


def encode(a: Assignment) -> str:
    return json.dumps({"p": a.primary, "b": a.backup}, separators=(",", ":"))


def decode(value: bytes) -> Assignment:
    doc = json.loads(value)
    return Assignment(str(doc["p"]), None if doc["b"] is None else str(doc["b"]))


def create_ops(key: str, seq_key: str, value: str, seen_seq: int, tx: Any, lease: int) -> tuple[list, list, list]:
    """Create the session if absent and no assignment of its primary happened since `seen_seq`."""
    return ([tx.version(key) == 0, tx.mod(seq_key) == seen_seq],
            [tx.put(key, value, lease=lease), tx.put(seq_key, ""), tx.get(key)],
            [tx.get(key), tx.get(seq_key)])


def refresh_ops(key: str, value: str, mod_revision: int, tx: Any, lease: int) -> tuple[list, list, list]:
    """Re-lease only if unchanged since read: never resurrect an expired key or overwrite a new assignment."""
    return [tx.mod(key) == mod_revision], [tx.put(key, value, lease=lease), tx.get(key)], []


class LeaseWindows:
    """The lease this replica puts assignments on now: a new one every `window_s`, never kept alive."""

    def __init__(self, idle_ttl_s: float, window_s: float):
        self.ttl = math.ceil(idle_ttl_s + window_s)
        self.window_s = window_s
        self._lock = threading.Lock()
        self._lease: tuple[int, float] | None = None

    def current(self, client: pyetcd.client, granted: dict[int, float]) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease is None or now - self._lease[1] >= self.window_s:
                lease = client.lease(self.ttl)
                self._lease = (lease.id, now)
                for old, expires in list(granted.items()):  # forget long-expired windows
                    if expires < now - self.ttl:
                        del granted[old]
                granted[lease.id] = now + lease.ttl
            return self._lease[0]

    def drop(self) -> None:
        with self._lock:
            self._lease = None
