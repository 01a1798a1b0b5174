"""runc + CRIU backend: containers whose whole process tree can be checkpointed, restored and forked live.

A snapshot freezes the container and, within that one freeze, copies the overlay upper layer while CRIU
dumps the process tree leaving it running (criu_dump), so files and memory are from the same instant.
Restore and fork start new containers from those images over copies of the upper layer (`runc restore`).
The host kernel lacks soft-dirty tracking, so CRIU pre-dumps (incremental snapshots) are unavailable here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Coroutine
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
from services.sandbox.backends.cgroups import CGROUP_ROOT, remove_group, remove_tree
from services.sandbox.backends.cgroups import probe as probe_cgroups
from services.sandbox.backends.criu_dump import (
    DESCRIPTORS,
    dump_leave_running,
    feed_descriptors,
    link_images,
    log_errors,
    make_images_dir,
    release_orphaned_reader,
)
from services.sandbox.backends.criu_options import CriuOptions
from services.sandbox.backends.launch import background_argv, command_env, frozen, gather_all, require_tools
from services.sandbox.backends.overlay import OverlayDisk, copy_tree
from services.sandbox.backends.runc_cli import RuncCli
from services.sandbox.backends.runc_config import prepare_dev_dir, runc_config
from services.sandbox.backends.streaming import stream_command
from services.sandbox.backends.tagged_kill import terminate_tagged
from services.sandbox.errors import BackendFailure
from services.sandbox.images import Image

CGROUP_GROUP = "k3sandbox-criu"
EXEC_TAG = "K3_EXEC_ID"
TERM_GRACE_S = 1.0
# Fork dumps live only for the call: on a tmpfs they skip the disk filesystem's block allocation.
SCRATCH_DIR = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


class CriuBackend(SandboxBackend):
    name = "criu"
    capabilities = Capabilities(memory_snapshot=True, incremental=False, live_fork=True, hibernate=True)

    def __init__(self, root_dir: Path) -> None:
        self.root_dir = Path(root_dir)
        self.criu_options = CriuOptions(self.root_dir)
        # This backend's own fork scratch space (one per root dir, so two managers never touch each other's).
        self.scratch = SCRATCH_DIR / f"k3-criu-{hashlib.sha1(str(self.root_dir).encode()).hexdigest()[:12]}"
        self.runc = RuncCli(self.root_dir / ".runc", self.criu_options.env(dict(os.environ)))

    @classmethod
    def probe(cls) -> str | None:
        missing = require_tools("runc", "criu") or probe_cgroups()
        if missing:
            return missing
        check = subprocess.run(["criu", "check"], capture_output=True, text=True)
        if check.returncode != 0:
            return f"`criu check` fails on this kernel: {(check.stderr or check.stdout).strip()[-300:]}"
        return None

    def _prepare(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        sb = SandboxHandle(sandbox_id, image, limits, env, self.root_dir / sandbox_id)
        disk = OverlayDisk(sb.dir, image.rootfs, limits.disk_bytes)
        sb.state.update(disk=disk, freezer=CGROUP_ROOT / "freezer" / CGROUP_GROUP / sandbox_id)
        return sb

    def _write_bundle(self, sb: SandboxHandle, restoring: bool = False) -> None:
        disk: OverlayDisk = sb.state["disk"]
        dev = sb.dir / "dev"
        prepare_dev_dir(dev)
        config = runc_config(disk.merged, dev, sb.sandbox_id[:63], f"/{CGROUP_GROUP}/{sb.sandbox_id}", sb.limits,
                             sb.image.host_usr, self.criu_options.annotations, restoring)
        (sb.dir / "config.json").write_text(json.dumps(config))

    async def _start(self, sb: SandboxHandle, *runc_args: str) -> None:
        """`runc run` or `runc restore` of the bundle, detached; records the init's host pid for dumps."""
        await self._finish_start(sb, await self._spawn_start(sb, *runc_args), runc_args[0])

    async def _spawn_start(self, sb: SandboxHandle, *runc_args: str) -> asyncio.subprocess.Process:
        return await self.runc.spawn(*runc_args, "-d", "--pid-file", str(sb.dir / "init.pid"), "--bundle",
                                     str(sb.dir), sb.sandbox_id, log=sb.dir / "runc.log")

    async def _finish_start(self, sb: SandboxHandle, proc: asyncio.subprocess.Process, command: str) -> None:
        try:
            await self.runc.wait(proc, command, sb.dir / "runc.log")
        except BackendFailure as e:
            if command == "restore":
                raise BackendFailure(f"{e} | criu: {log_errors(sb.dir / 'restore-work' / 'restore.log')}") from e
            raise
        sb.state["pid"] = int((sb.dir / "init.pid").read_text())

    async def create(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        sb = self._prepare(sandbox_id, image, limits, env)
        try:
            await sb.state["disk"].mount()
            self._write_bundle(sb)
            await self._start(sb, "run")
        except BaseException:
            await self.destroy(sb)
            raise
        return sb

    def exec(self, sb: SandboxHandle, spec: ExecSpec) -> AsyncIterator[ExecChunk]:
        exec_id = os.urandom(8).hex()
        argv = [*self.runc.prefix, "exec", "--user", f"{SANDBOX_UID}:{SANDBOX_UID}"]
        argv += ["--cwd", spec.cwd, "--no-new-privs"]
        for k, v in {**command_env(sb.env, spec.env), EXEC_TAG: exec_id}.items():
            argv += ["--env", f"{k}={v}"]
        # Through `env`, a missing program exits 127 as in a shell (runc itself would fail with 255).
        inner = background_argv(spec.argv, exec_id) if spec.background else ["env", "--", *spec.argv]
        argv += [sb.sandbox_id, *inner]

        async def terminate() -> None:
            procs = CGROUP_ROOT / "pids" / CGROUP_GROUP / sb.sandbox_id / "cgroup.procs"
            await terminate_tagged(self, sb, procs, f"{EXEC_TAG}={exec_id}".encode(), TERM_GRACE_S)

        return stream_command(argv, spec.stdin, spec.timeout_s, terminate)

    async def _set_frozen(self, sb: SandboxHandle, frozen_: bool) -> None:
        # Writing the v1 freezer directly (as `runc pause` does) avoids a runc process per call: ~0.2 ms.
        state_file: Path = sb.state["freezer"] / "freezer.state"
        want = "FROZEN" if frozen_ else "THAWED"
        state_file.write_text(want)
        for _ in range(4000):
            if state_file.read_text().strip() == want:
                sb.paused = frozen_
                return
            await asyncio.sleep(0.0005)
        raise BackendFailure(f"freezer of {sb.sandbox_id} did not reach {want}")

    async def pause(self, sb: SandboxHandle) -> None:
        await self._set_frozen(sb, True)

    async def resume(self, sb: SandboxHandle) -> None:
        if sb.hibernated:
            await self._wake(sb)
        await self._set_frozen(sb, False)

    async def hibernate(self, sb: SandboxHandle) -> None:
        """Checkpoints the frozen container to disk and lets runc remove it: its memory and cgroups go away,
        its files stay on the sandbox's disk, and `resume` restores it under the same id."""
        if sb.hibernated:
            return
        if not sb.paused:
            await self.pause(sb)
        images = sb.dir / "hibernation"
        shutil.rmtree(images, ignore_errors=True)
        await self.runc.run("checkpoint", "--image-path", str(images / "memory"), "--work-path",
                            str(images / "work"), sb.sandbox_id)
        os.chmod(images / "memory", 0o700)
        sb.hibernated = True

    async def _wake(self, sb: SandboxHandle) -> None:
        """Restores a hibernated container; it comes back running (CRIU leaves cgroup state alone)."""
        images = sb.dir / "hibernation"
        await self._restore_into(sb, images / "memory")
        shutil.rmtree(images, ignore_errors=True)
        sb.hibernated = False
        sb.paused = False

    async def _checkpoint(self, sb: SandboxHandle, images: Path, *copies: Coroutine) -> Path:
        """Dumps the live memory state into `images` while `copies` (of its files) run, all inside one freeze,
        so files and memory are from the same instant; returns where the memory images are. A hibernated
        sandbox's images already are such a checkpoint: they are used as they are, and it stays hibernated."""
        if sb.hibernated:
            await gather_all(*copies)
            return sb.dir / "hibernation" / "memory"
        make_images_dir(images)
        async with frozen(self, sb):
            dump = dump_leave_running(sb.state["pid"], sb.dir, sb.state["freezer"], images, images.parent / "work")
            await gather_all(dump, *copies)
        return images

    async def snapshot(self, sb: SandboxHandle, snapshot_id: str, dest: Path) -> SnapshotRef:
        memory = await self._checkpoint(sb, dest / "memory", sb.state["disk"].save_upper(dest / "upper"))
        if memory != dest / "memory":
            await copy_tree(memory, dest / "memory")
        return SnapshotRef(snapshot_id, self.name, dest, sb.image.name, sb.limits, sb.env, memory=True)

    async def _restore_into(self, sb: SandboxHandle, images: Path) -> None:
        self._write_bundle(sb, restoring=True)
        await self._start(sb, *self._restore_args(sb, images))

    @staticmethod
    def _restore_args(sb: SandboxHandle, images: Path) -> tuple[str, ...]:
        return "restore", "--image-path", str(images), "--work-path", str(sb.dir / "restore-work")

    async def restore(self, ref: SnapshotRef, sandbox_id: str, image: Image) -> SandboxHandle:
        sb = self._prepare(sandbox_id, image, ref.limits, ref.env)
        try:
            await sb.state["disk"].mount(seed_upper=ref.dir / "upper")
            await self._restore_into(sb, ref.dir / "memory")
        except BaseException:
            await self.destroy(sb)
            raise
        return sb

    async def fork(self, sb: SandboxHandle, sandbox_ids: list[str]) -> list[SandboxHandle]:
        """One dump, restored `len(sandbox_ids)` times concurrently. The dump goes to a tmpfs (it lives only
        for this call), and each copy's disk is seeded straight from the frozen parent's upper layer while
        CRIU dumps, instead of through a staged copy."""
        copies = [self._prepare(i, sb.image, sb.limits, sb.env) for i in sandbox_ids]
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"fork-{sb.sandbox_id}-", dir=self.scratch))
        try:
            if sb.hibernated:
                upper = sb.state["disk"].upper
                memory = await self._checkpoint(sb, staging, *(c.state["disk"].mount(seed_upper=upper) for c in copies))
                await gather_all(*(self._restore_into(c, memory) for c in copies))
            else:
                await self._fork_live(sb, copies, staging)
            return copies
        except BaseException:
            for c in copies:
                await self.destroy(c)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def _fork_live(self, sb: SandboxHandle, copies: list[SandboxHandle], staging: Path) -> None:
        """Each copy's `runc restore` starts while CRIU dumps, as soon as its disk is seeded: runc's own
        start-up (a Go process, a CRIU version probe, the restore mounts) overlaps the dump, and it waits on
        its images' descriptors.json FIFO until the dump is complete."""
        images = [staging / f"images-{i}" for i in range(len(copies))]
        for d in images:
            make_images_dir(d, descriptors_fifo=True)
        upper = sb.state["disk"].upper
        started: list[tuple[SandboxHandle, Path, asyncio.subprocess.Process]] = []

        async def stage(copy: SandboxHandle, copy_images: Path) -> None:
            await copy.state["disk"].mount(seed_upper=upper)
            self._write_bundle(copy, restoring=True)
            started.append((copy, copy_images, await self._spawn_start(copy, *self._restore_args(copy, copy_images))))

        async def finish(copy: SandboxHandle, copy_images: Path, proc: asyncio.subprocess.Process) -> None:
            await feed_descriptors(copy_images, proc, complete)
            await self._finish_start(copy, proc, "restore")

        complete = False
        try:
            async with frozen(self, sb):
                dump = dump_leave_running(sb.state["pid"], sb.dir, sb.state["freezer"], images[0], staging / "work")
                await gather_all(dump, *(stage(c, d) for c, d in zip(copies, images, strict=True)))
            for d in images[1:]:
                link_images(images[0], d)
            complete = True
        finally:  # every started runc is released (and waited for), also when the dump failed
            results = await asyncio.gather(*(finish(*s) for s in started), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def destroy(self, sb: SandboxHandle) -> None:
        if (self.runc.state_dir / sb.sandbox_id).exists():
            with contextlib.suppress(BackendFailure):
                await self.runc.run("kill", sb.sandbox_id, "KILL")
            if sb.paused:  # a frozen task cannot act on SIGKILL until thawed
                with contextlib.suppress(OSError, BackendFailure):
                    await self._set_frozen(sb, False)
            await self.runc.run("delete", "--force", sb.sandbox_id)
        sb.state["disk"].unmount()
        for controller in ("memory", "cpu", "pids", "freezer", "unified"):
            remove_tree(CGROUP_ROOT / controller / CGROUP_GROUP / sb.sandbox_id)
        shutil.rmtree(sb.dir, ignore_errors=True)

    def release_host_state(self) -> None:
        remove_group(CGROUP_GROUP)
        with contextlib.suppress(OSError):
            self.scratch.rmdir()

    async def reap_orphans(self) -> list[str]:
        # A manager that died mid-fork left `runc restore`s blocked on their images' FIFOs: release them
        # empty, on which they fail and undo their own mounts, before their sandboxes are torn down.
        for fifo in self.scratch.glob(f"fork-*/images-*/{DESCRIPTORS}"):
            release_orphaned_reader(fifo)
        shutil.rmtree(self.scratch, ignore_errors=True)
        reaped = []
        for d in sorted(self.root_dir.glob("sbx-*")):
            sb = SandboxHandle(d.name, None, None, {}, d, paused=True)  # type: ignore[arg-type] - teardown only
            sb.state.update(disk=OverlayDisk(d, Path("/nonexistent"), 0),
                            freezer=CGROUP_ROOT / "freezer" / CGROUP_GROUP / d.name)
            await self.destroy(sb)
            reaped.append(d.name)
        return reaped

    def memory_bytes(self, sb: SandboxHandle) -> int:
        if sb.hibernated:
            return sb.state["disk"].used_bytes()  # only its files, held in the sandbox's tmpfs
        try:
            usage = CGROUP_ROOT / "memory" / CGROUP_GROUP / sb.sandbox_id / "memory.usage_in_bytes"
            return int(usage.read_text())
        except FileNotFoundError:
            return 0

