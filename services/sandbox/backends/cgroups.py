"""Cgroups of one namespace sandbox on a hybrid host: v1 memory/cpu/pids limits, v2 freeze and kill.

v2's cgroup.freeze stops every task at once and reports completion in cgroup.events (about 0.1 ms), and
cgroup.kill SIGKILLs the whole subtree atomically, so a fork bomb cannot outrun a kill loop. Each command
gets its own v2 child cgroup so one command can be killed without touching the others.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from services.sandbox.backends.base import Limits
from services.sandbox.errors import BackendFailure

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNIFIED = CGROUP_ROOT / "unified"
V1_CONTROLLERS = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000


def cfs_quota_us(cpu_millis: int) -> int:
    """The CFS quota per CFS_PERIOD_US that grants `cpu_millis` thousandths of a core."""
    return cpu_millis * CFS_PERIOD_US // 1000


def probe() -> str | None:
    for c in V1_CONTROLLERS:
        if not (CGROUP_ROOT / c / "cgroup.procs").exists():
            return f"cgroup v1 controller {c} is not mounted at {CGROUP_ROOT / c}"
    if not (UNIFIED / "cgroup.procs").exists():
        return f"cgroup v2 is not mounted at {UNIFIED}"
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise BackendFailure(f"write {value!r} to {path}: {e.strerror}") from e


def remove_tree(path: Path) -> None:
    """rmdir bottom-up (cgroup dirs cannot be rmtree'd: their control files are not removable)."""
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_dir():
            remove_tree(child)
    try:
        path.rmdir()
    except OSError:
        pass  # a task is still exiting; the caller killed it, the next cleanup pass gets the directory


def remove_group(group: str) -> None:
    """Removes a backend's parent cgroup in every hierarchy, if no sandbox (of any manager) is left in it."""
    for hierarchy in CGROUP_ROOT.iterdir():
        path = hierarchy / group
        try:
            if not any(p.is_dir() for p in path.iterdir()):
                path.rmdir()
        except OSError:
            pass  # absent, or another manager's sandbox is (or just arrived) there


class SandboxCgroups:
    def __init__(self, group: str, sandbox_id: str) -> None:
        self.rel = f"{group}/{sandbox_id}"
        self.v1 = {c: CGROUP_ROOT / c / self.rel for c in V1_CONTROLLERS}
        self.v2 = UNIFIED / self.rel

    def create(self, limits: Limits) -> None:
        for d in (*self.v1.values(), self.v2):
            d.mkdir(parents=True, exist_ok=True)
        mem = self.v1["memory"]
        _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(self.v1["cpu"] / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(self.v1["cpu"] / "cpu.cfs_quota_us", str(cfs_quota_us(limits.cpu_millis)))
        _write(self.v1["pids"] / "pids.max", str(limits.pids))

    def procs_files(self, v2_child: str | None = None) -> list[str]:
        """The cgroup.procs files a new task writes its pid into to join this sandbox."""
        v2 = self.v2 / v2_child if v2_child else self.v2
        if v2_child:
            v2.mkdir(exist_ok=True)
        return [str(d / "cgroup.procs") for d in (*self.v1.values(), v2)]

    async def set_frozen(self, frozen: bool) -> None:
        _write(self.v2 / "cgroup.freeze", "1" if frozen else "0")
        want = f"frozen {int(frozen)}"
        for _ in range(2000):  # the kernel flips cgroup.events once every task has stopped
            if want in (self.v2 / "cgroup.events").read_text():
                return
            await asyncio.sleep(0.0005)
        raise BackendFailure(f"cgroup {self.v2} did not reach '{want}'")

    def pids(self, v2_child: str | None = None) -> list[int]:
        path = (self.v2 / v2_child if v2_child else self.v2) / "cgroup.procs"
        try:
            return [int(p) for p in path.read_text().split()]
        except FileNotFoundError:
            return []

    async def terminate(self, v2_child: str | None, grace_s: float) -> None:
        """SIGTERM, then cgroup.kill once `grace_s` has passed: a task ignoring SIGTERM still dies."""
        target = self.v2 / v2_child if v2_child else self.v2
        for pid in self.pids(v2_child):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.pids(v2_child) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await self.kill(target)

    async def kill(self, target: Path | None = None) -> None:
        target = target or self.v2
        if not target.exists():
            return
        # A frozen task cannot die until thawed; kill first so nothing runs in between.
        _write(target / "cgroup.kill", "1")
        if (target / "cgroup.freeze").read_text().strip() == "1":
            _write(target / "cgroup.freeze", "0")
        for _ in range(500):
            if not self._populated(target):
                return
            await asyncio.sleep(0.01)
        raise BackendFailure(f"tasks in {target} survived cgroup.kill")

    @staticmethod
    def _populated(target: Path) -> bool:
        try:
            return "populated 1" in (target / "cgroup.events").read_text()
        except FileNotFoundError:
            return False

    def memory_bytes(self) -> int:
        try:
            return int((self.v1["memory"] / "memory.usage_in_bytes").read_text())
        except FileNotFoundError:
            return 0

    def remove(self) -> None:
        for d in (*self.v1.values(), self.v2):
            remove_tree(d)
