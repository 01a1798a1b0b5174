"""The sandbox manager: lifecycle, tenant quotas, limits, idle auto-pause, TTL destroy, periodic snapshots.

Every sandbox belongs to one backend; the manager owns the bookkeeping the backends do not: who owns what,
when each sandbox was last used, which snapshots exist (persisted beside their data so a restarted manager
can still restore them), and the housekeeping loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from services.sandbox import metrics
from services.sandbox.backends.base import (
    ExecChunk,
    ExecSpec,
    SandboxBackend,
    SandboxHandle,
)
from services.sandbox.config import SandboxConfig
from services.sandbox.errors import InvalidRequest, NotFound, QuotaExceeded, WrongState
from services.sandbox.images import ImageStore
from services.sandbox.limits import LimitRequest, resolve_limits
from services.sandbox.record import Sandbox
from services.sandbox.snapshots import Snapshot, SnapshotStore

log = logging.getLogger("k3.sandbox")
_TOMBSTONES = 10_000


class SandboxManager:
    def __init__(self, config: SandboxConfig, backends: dict[str, SandboxBackend]) -> None:
        self.config = config
        self.backends = backends
        root = Path(config.root_dir)
        self.images = ImageStore(root / "images")
        self.snapshot_store = SnapshotStore(root / "snapshots")
        self.snapshots = self.snapshot_store.snapshots
        self.sandboxes: dict[str, Sandbox] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # destroyed id -> why, for clear errors
        self._housekeeper: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def create(self, image: str, tenant: str, limits: LimitRequest, backend: str = "",
                     idle_pause_s: float = 0, ttl_s: float = 0, snapshot_interval_s: float = 0,
                     env: dict[str, str] | None = None) -> Sandbox:
        be = self._backend(backend or self.config.default_backend)
        resolved = resolve_limits(limits, self.config)
        tenant = _tenant(tenant)
        self._check_quota(tenant, resolved.memory_bytes, 1)
        img = self.images.get(image or "base")
        sid = _new_id("sbx")
        with metrics.timed("create", be.name):
            handle = await be.create(sid, img, resolved, dict(env or {}))
        return self._register(sid, tenant, be, handle, idle_pause_s, ttl_s, snapshot_interval_s)

    def _register(self, sid: str, tenant: str, be: SandboxBackend, handle: SandboxHandle, idle_pause_s: float,
                  ttl_s: float, snapshot_interval_s: float) -> Sandbox:
        sb = Sandbox(sid, tenant, be, handle, idle_pause_s, ttl_s, snapshot_interval_s)
        if snapshot_interval_s:
            sb.next_snapshot = time.monotonic() + snapshot_interval_s
        self.sandboxes[sid] = sb
        log.info("sandbox created", extra={"sandbox": sid, "tenant": tenant, "backend": be.name})
        return sb

    def get(self, sandbox_id: str) -> Sandbox:
        if not sandbox_id:
            raise InvalidRequest("sandbox_id", "must not be empty")
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            why = self._gone.get(sandbox_id)
            raise NotFound(f"sandbox {sandbox_id} was destroyed ({why})" if why
                           else f"sandbox {sandbox_id} not found")
        return sb

    def list(self, tenant: str = "") -> list[Sandbox]:
        return [s for s in self.sandboxes.values() if not tenant or s.tenant == tenant]

    async def destroy(self, sandbox_id: str, reason: str = "destroyed by request") -> None:
        sb = self.get(sandbox_id)
        async with sb.lock:
            if self.sandboxes.pop(sandbox_id, None) is None:
                return  # a concurrent destroy won
            self._gone[sandbox_id] = reason
            while len(self._gone) > _TOMBSTONES:
                self._gone.popitem(last=False)
            with metrics.timed("destroy", sb.backend.name):
                await sb.backend.destroy(sb.handle)
        log.info("sandbox destroyed", extra={"sandbox": sandbox_id, "reason": reason})

    # ---- running things inside --------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncIterator[ExecChunk]:
        if not spec.argv or not spec.argv[0]:
            raise InvalidRequest("argv", "must name a program")
        sb = self.get(sandbox_id)
        wall = sb.handle.limits.wall_clock_s
        spec.timeout_s = min(spec.timeout_s, wall) if spec.timeout_s > 0 else wall
        await self._ensure_running(sb)
        sb.running_execs += 1
        sb.touch()
        try:
            async for chunk in sb.backend.exec(sb.handle, spec):
                yield chunk
        finally:
            sb.running_execs -= 1
            sb.touch()

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        sb = await self._for_file(sandbox_id, path)
        return await sb.backend.read_file(sb.handle, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> int:
        sb = await self._for_file(sandbox_id, path)
        return await sb.backend.write_file(sb.handle, path, data, mode or 0o644)

    async def _for_file(self, sandbox_id: str, path: str) -> Sandbox:
        if not path.startswith("/"):
            raise InvalidRequest("path", f"must be absolute, got {path!r}")
        sb = self.get(sandbox_id)
        await self._ensure_running(sb)
        sb.touch()
        return sb

    async def _ensure_running(self, sb: Sandbox) -> None:
        """Using a paused sandbox resumes it (an agent returning from a model call just carries on)."""
        if sb.paused:
            async with sb.lock:
                if sb.paused:
                    await sb.backend.resume(sb.handle)

    # ---- pause, snapshot, restore, fork -----------------------------------------------------------------
    async def pause(self, sandbox_id: str, release_memory: bool = False) -> float:
        """Freezes the sandbox (no CPU); with `release_memory`, also checkpoints it to disk and frees its
        memory (backends with `capabilities.hibernate`), at the price of a restore on resume."""
        sb = self.get(sandbox_id)
        if release_memory and not sb.backend.capabilities.hibernate:
            raise WrongState(f"the {sb.backend.name} backend cannot release memory on pause; "
                             "pause without release_memory or use a backend that can (criu)")
        async with sb.lock:
            if release_memory and not sb.handle.hibernated:
                self._check_checkpointable(sb)
                with metrics.timed("hibernate", sb.backend.name) as t:
                    await sb.backend.hibernate(sb.handle)
                return t.ms
            if sb.paused:
                return 0.0
            with metrics.timed("pause", sb.backend.name) as t:
                await sb.backend.pause(sb.handle)
        return t.ms

    async def resume(self, sandbox_id: str) -> float:
        sb = self.get(sandbox_id)
        sb.touch()
        async with sb.lock:
            if not sb.paused:
                return 0.0
            with metrics.timed("resume", sb.backend.name) as t:
                await sb.backend.resume(sb.handle)
        return t.ms

    async def snapshot(self, sandbox_id: str, periodic: bool = False) -> tuple[Snapshot, float]:
        sb = self.get(sandbox_id)
        async with sb.lock:
            self._check_checkpointable(sb)
            snap_id = _new_id("snap")
            try:
                with metrics.timed("snapshot", sb.backend.name) as t:
                    ref = await sb.backend.snapshot(sb.handle, snap_id, self.snapshot_store.path_for(snap_id))
            except BaseException:
                self.snapshot_store.discard(snap_id)
                raise
        snap = Snapshot(ref, sb.tenant, sandbox_id)
        self.snapshot_store.add(snap)
        sb.snapshots.append(snap_id)
        if periodic:
            sb.periodic.append(snap_id)
            while len(sb.periodic) > self.config.keep_periodic_snapshots:
                self.delete_snapshot(sb.periodic.popleft())
        return snap, t.ms

    def _check_checkpointable(self, sb: Sandbox) -> None:
        # A foreground command's launcher lives outside the sandbox, so CRIU could not dump its process tree.
        if sb.backend.capabilities.memory_snapshot and sb.running_execs:
            raise WrongState(f"sandbox {sb.sandbox_id} has {sb.running_execs} command(s) running; "
                             "snapshot or fork once they finish (background commands are fine)")

    def delete_snapshot(self, snapshot_id: str) -> None:
        snap = self.snapshot_store.delete(snapshot_id)
        source = self.sandboxes.get(snap.source)
        if source is not None and snapshot_id in source.snapshots:
            source.snapshots.remove(snapshot_id)

    async def restore(self, snapshot_id: str) -> tuple[Sandbox, float]:
        snap = self.snapshot_store.get(snapshot_id)
        be = self._backend(snap.ref.backend)
        self._check_quota(snap.tenant, snap.ref.limits.memory_bytes, 1)
        sid = _new_id("sbx")
        with metrics.timed("restore", be.name) as t:
            handle = await be.restore(snap.ref, sid, self.images.get(snap.ref.image))
        return self._register(sid, snap.tenant, be, handle, 0, 0, 0), t.ms

    async def fork(self, sandbox_id: str, count: int) -> tuple[list[Sandbox], float]:
        sb = self.get(sandbox_id)
        if not 1 <= count <= self.config.max_fork_count:
            raise InvalidRequest("count", f"must be in [1, {self.config.max_fork_count}], got {count}")
        self._check_quota(sb.tenant, sb.handle.limits.memory_bytes * count, count)
        async with sb.lock:
            self._check_checkpointable(sb)
            ids = [_new_id("sbx") for _ in range(count)]
            with metrics.timed("fork", sb.backend.name) as t:
                handles = await sb.backend.fork(sb.handle, ids)
        sb.touch()
        children = [self._register(h.sandbox_id, sb.tenant, sb.backend, h, sb.idle_pause_s, sb.ttl_s,
                                   sb.snapshot_interval_s) for h in handles]
        return children, t.ms

    def set_ttl(self, sandbox_id: str, ttl_s: float) -> None:
        sb = self.get(sandbox_id)
        sb.ttl_s = ttl_s
        sb.touch()

    # ---- quotas, housekeeping ------------------------------------------------------------------------------
    def _backend(self, name: str) -> SandboxBackend:
        be = self.backends.get(name)
        if be is None:
            raise InvalidRequest("backend", f"unknown or unavailable backend {name!r}; available: "
                                 f"{', '.join(sorted(self.backends)) or 'none'}")
        return be

    def _check_quota(self, tenant: str, memory_bytes: int, count: int) -> None:
        mine = self.list(tenant)
        if len(mine) + count > self.config.max_sandboxes_per_tenant:
            raise QuotaExceeded(f"tenant {tenant!r} would have {len(mine) + count} sandboxes; the quota is "
                                f"{self.config.max_sandboxes_per_tenant}", retry_after_ms=5000)
        used = sum(s.handle.limits.memory_bytes for s in mine)
        if used + memory_bytes > self.config.max_memory_per_tenant_bytes:
            raise QuotaExceeded(f"tenant {tenant!r} would reserve {used + memory_bytes} bytes of memory; the "
                                f"quota is {self.config.max_memory_per_tenant_bytes}", retry_after_ms=5000)

    async def start(self) -> None:
        for be in self.backends.values():
            reaped = await be.reap_orphans()
            if reaped:
                log.warning("destroyed sandboxes left by a previous run", extra={"backend": be.name,
                                                                                  "sandboxes": reaped})
        self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep_forever())

    async def _housekeep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            try:
                await self.housekeep()
            except Exception:  # noqa: BLE001 - one bad sandbox must not stop housekeeping for the rest
                log.exception("housekeeping pass failed")

    async def housekeep(self) -> None:
        now = time.monotonic()
        for sb in list(self.sandboxes.values()):
            idle = now - sb.last_active if sb.running_execs == 0 else 0.0
            with contextlib.suppress(NotFound):
                if sb.ttl_s and idle >= sb.ttl_s:
                    await self.destroy(sb.sandbox_id, reason=f"idle for {idle:.0f}s, ttl {sb.ttl_s:.0f}s")
                    continue
                if sb.idle_pause_s and not sb.handle.hibernated and idle >= sb.idle_pause_s:
                    release = self.config.hibernate_when_idle and sb.backend.capabilities.hibernate
                    if release or not sb.paused:
                        await self.pause(sb.sandbox_id, release_memory=release)
                if sb.snapshot_interval_s and now >= sb.next_snapshot and not sb.running_execs:
                    sb.next_snapshot = now + sb.snapshot_interval_s
                    await self.snapshot(sb.sandbox_id, periodic=True)
        metrics.observe_population(self.sandboxes.values(), self.backends)

    async def close(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        for sid in list(self.sandboxes):
            with contextlib.suppress(NotFound):
                await self.destroy(sid, reason="manager shut down")
        for be in self.backends.values():
            be.release_host_state()


def _tenant(tenant: str) -> str:
    tenant = tenant or "default"
    if len(tenant) > 128 or not tenant.isprintable():
        raise InvalidRequest("tenant", "must be printable and at most 128 characters")
    return tenant


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"
