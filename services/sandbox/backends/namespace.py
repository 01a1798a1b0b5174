"""Namespace backend: bubblewrap (pid/ipc/uts/net/mount namespaces) over an overlay root, cgroup limits.

Always available on Linux. Snapshots and forks carry the filesystem (the overlay upper layer, copied while
the sandbox is frozen so it is consistent); processes are not carried, so a restored or forked sandbox starts
with a fresh init. Pause is cgroup v2 freeze rather than SIGSTOP: SIGSTOP is visible to the tenant (a parent
gets SIGCHLD, a process can SIGCONT its sibling) and races with forks; the freezer is atomic and invisible.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from services.sandbox.backends.base import (
    SANDBOX_UID,
    Capabilities,
    ExecChunk,
    ExecSpec,
    Limits,
    SandboxBackend,
    SandboxHandle,
    SnapshotRef,
)
from services.sandbox.backends.cgroups import SandboxCgroups, remove_group, remove_tree
from services.sandbox.backends.cgroups import probe as probe_cgroups
from services.sandbox.backends.launch import (
    background_argv,
    command_env,
    frozen,
    join_cgroups_argv,
    require_tools,
    start_all,
)
from services.sandbox.backends.overlay import OverlayDisk
from services.sandbox.backends.streaming import stream_command
from services.sandbox.errors import BackendFailure
from services.sandbox.images import Image

CGROUP_GROUP = "k3sandbox-ns"
TERM_GRACE_S = 1.0


class NamespaceBackend(SandboxBackend):
    name = "namespace"
    capabilities = Capabilities(memory_snapshot=False, incremental=False, live_fork=False)

    def __init__(self, root_dir: Path) -> None:
        self.root_dir = Path(root_dir)
        self._exec_ids = itertools.count()

    @classmethod
    def probe(cls) -> str | None:
        return require_tools("bwrap", "nsenter", "setpriv") or probe_cgroups()

    async def create(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        return await self._start(sandbox_id, image, limits, env, seed_upper=None)

    async def _start(
        self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str], seed_upper: Path | None
    ) -> SandboxHandle:
        sb = SandboxHandle(sandbox_id, image, limits, env, self.root_dir / sandbox_id)
        disk = OverlayDisk(sb.dir, image.rootfs, limits.disk_bytes)
        cgroups = SandboxCgroups(CGROUP_GROUP, sandbox_id)
        sb.state.update(disk=disk, cgroups=cgroups)
        try:
            await disk.mount(seed_upper)
            cgroups.create(limits)
            bwrap = ["bwrap", "--bind", str(disk.merged), "/"]
            if image.host_usr:
                bwrap += ["--ro-bind", "/usr", "/usr"]
            bwrap += ["--proc", "/proc", "--dev", "/dev", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
            bwrap += ["--unshare-cgroup-try", "--hostname", sandbox_id[:63], "--die-with-parent"]
            bwrap += ["--new-session", "--chdir", "/"]
            if not limits.network:
                bwrap.append("--unshare-net")  # only a loopback interface inside
            # bwrap's own pid 1 reaps orphans; `sleep` is the anchor `nsenter` targets for every command.
            argv = join_cgroups_argv(cgroups.procs_files(), [*bwrap, "--", "sleep", "infinity"])
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL
            )
            sb.state["proc"] = proc
            sb.state["anchor_pid"] = await _find_anchor(proc.pid)
        except BaseException:
            await self.destroy(sb)
            raise
        return sb

    def exec(self, sb: SandboxHandle, spec: ExecSpec) -> AsyncIterator[ExecChunk]:
        cgroups: SandboxCgroups = sb.state["cgroups"]
        child = f"exec-{next(self._exec_ids)}"
        env = command_env(sb.env, spec.env)
        inner = background_argv(spec.argv, child) if spec.background else spec.argv
        # nsenter would resolve a --wd path on the host side, so the directory change is env's (-C).
        argv = ["nsenter", "-t", str(sb.state["anchor_pid"]), "-m", "-u", "-i", "-n", "-p", "-r", "-w"]
        argv += ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
        argv += ["--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]
        argv += ["env", "-i", "-C", spec.cwd, *(f"{k}={v}" for k, v in env.items()), *inner]

        async def terminate() -> None:
            await cgroups.terminate(child, TERM_GRACE_S)

        async def run() -> AsyncIterator[ExecChunk]:
            try:
                async for chunk in stream_command(join_cgroups_argv(cgroups.procs_files(child), argv), spec.stdin,
                                                  spec.timeout_s, terminate):
                    yield chunk
            finally:
                if not spec.background:
                    remove_tree(cgroups.v2 / child)  # kept only while something still runs in it

        return run()

    async def pause(self, sb: SandboxHandle) -> None:
        await sb.state["cgroups"].set_frozen(True)
        sb.paused = True

    async def resume(self, sb: SandboxHandle) -> None:
        await sb.state["cgroups"].set_frozen(False)
        sb.paused = False

    async def snapshot(self, sb: SandboxHandle, snapshot_id: str, dest: Path) -> SnapshotRef:
        async with frozen(self, sb):
            await sb.state["disk"].save_upper(dest / "upper")
        return SnapshotRef(snapshot_id, self.name, dest, sb.image.name, sb.limits, sb.env, memory=False)

    async def restore(self, ref: SnapshotRef, sandbox_id: str, image: Image) -> SandboxHandle:
        return await self._start(sandbox_id, image, ref.limits, ref.env, seed_upper=ref.dir / "upper")

    async def fork(self, sb: SandboxHandle, sandbox_ids: list[str]) -> list[SandboxHandle]:
        staging = sb.dir / "fork-staging"
        try:
            async with frozen(self, sb):
                await sb.state["disk"].save_upper(staging)
            starts = [self._start(i, sb.image, sb.limits, sb.env, seed_upper=staging) for i in sandbox_ids]
            return await start_all(self, starts)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def destroy(self, sb: SandboxHandle) -> None:
        cgroups: SandboxCgroups = sb.state["cgroups"]
        await cgroups.kill()
        proc = sb.state.get("proc")
        if proc is not None and proc.returncode is None:
            await proc.wait()
        sb.state["disk"].unmount()
        cgroups.remove()
        shutil.rmtree(sb.dir, ignore_errors=True)

    def memory_bytes(self, sb: SandboxHandle) -> int:
        return sb.state["cgroups"].memory_bytes()

    def release_host_state(self) -> None:
        remove_group(CGROUP_GROUP)

    async def reap_orphans(self) -> list[str]:
        reaped = []
        for d in sorted(self.root_dir.glob("sbx-*")):
            sb = SandboxHandle(d.name, None, None, {}, d)  # type: ignore[arg-type] - only teardown state is used
            sb.state.update(disk=OverlayDisk(d, Path("/nonexistent"), 0), cgroups=SandboxCgroups(CGROUP_GROUP, d.name))
            await self.destroy(sb)
            reaped.append(d.name)
        return reaped


async def _find_anchor(bwrap_pid: int) -> int:
    """The pid (host view) of `sleep` inside the new namespaces: present only after bwrap's setup is done."""
    for _ in range(1000):
        ns_init = _children(bwrap_pid)
        anchor = _children(ns_init[0]) if ns_init else []
        if anchor:
            return anchor[0]
        await asyncio.sleep(0.002)
    raise BackendFailure("bubblewrap did not start the sandbox within 2 s")


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
