"""What the manager keeps about one live sandbox: owner, backend handle, idle and snapshot bookkeeping."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from services.sandbox.backends.base import SandboxBackend, SandboxHandle


@dataclass
class Sandbox:
    sandbox_id: str
    tenant: str
    backend: SandboxBackend
    handle: SandboxHandle
    idle_pause_s: float = 0
    ttl_s: float = 0
    snapshot_interval_s: float = 0
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    next_snapshot: float = 0
    snapshots: list[str] = field(default_factory=list)
    periodic: deque[str] = field(default_factory=deque)  # housekeeping's snapshots, oldest first (retention)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running_execs: int = 0

    @property
    def paused(self) -> bool:
        return self.handle.paused

    def touch(self) -> None:
        self.last_active = time.monotonic()
