"""Firecracker microVM backend, written against Firecracker's HTTP API (v1.x). UNTESTED HERE: these machines
expose /dev/kvm but cannot boot a guest, so `probe` reports it unavailable unless the binary and KVM work.

One `firecracker` process per sandbox, driven over its API socket:
  * create: machine-config (with `track_dirty_pages`), boot-source, a root drive that is a reflink/copy of the
    image's ext4, a vsock for the in-guest exec agent, no network interface (no network by default).
  * pause/resume: PATCH /vm {"state": "Paused" | "Resumed"} (vCPUs stop; guest memory stays mapped).
  * snapshot: the first is `Full`; later ones are `Diff` (only pages dirtied since the previous snapshot, the
    mechanism behind AgentENV's 133 ms incremental checkpoints). A Diff memory file is sparse, so it is
    layered onto a copy of its parent's file (data extents only) to give a loadable memory image.
  * restore / fork: a new process per copy, PUT /snapshot/load with a `File` memory backend. Firecracker maps
    that file MAP_PRIVATE, so every fork of one snapshot shares its pages copy-on-write in the page cache and
    only pays for what it dirties: this is where the memory overcommit comes from.
  * exec: JSON lines over the vsock to a guest agent listening on port 52 (an envd-like agent baked into
    the guest image; not part of this repository).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from services.sandbox.backends.base import (
    Capabilities,
    ExecChunk,
    ExecSpec,
    Limits,
    SandboxBackend,
    SandboxHandle,
    SnapshotRef,
)
from services.sandbox.backends.launch import require_tools, start_all
from services.sandbox.backends.streaming import TIMEOUT_EXIT_CODE
from services.sandbox.errors import BackendFailure
from services.sandbox.images import Image

AGENT_PORT = 52
GUEST_CID = 3
BOOT_ARGS = "console=ttyS0 reboot=k panic=1 pci=off quiet init=/sbin/k3-agent-init"


class FirecrackerBackend(SandboxBackend):
    name = "firecracker"
    capabilities = Capabilities(memory_snapshot=True, incremental=True, live_fork=True)

    def __init__(self, root_dir: Path) -> None:
        self.root_dir = Path(root_dir)

    @classmethod
    def probe(cls) -> str | None:
        missing = require_tools("firecracker")
        if missing:
            return missing
        try:
            os.close(os.open("/dev/kvm", os.O_RDWR))
        except OSError as e:
            return f"/dev/kvm is not usable: {e.strerror}"
        return None

    async def _api(self, sb: SandboxHandle, method: str, path: str, body: dict) -> None:
        connector = aiohttp.UnixConnector(path=str(sb.dir / "api.sock"))
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.request(method, f"http://localhost{path}", json=body) as resp:
                if resp.status >= 300:
                    raise BackendFailure(f"firecracker {method} {path}: {resp.status} {await resp.text()}")

    async def _spawn(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        sb = SandboxHandle(sandbox_id, image, limits, env, self.root_dir / sandbox_id)
        sb.dir.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            "firecracker", "--api-sock", str(sb.dir / "api.sock"), "--id", sandbox_id,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL)
        sb.state.update(proc=proc, generation=0)
        for _ in range(500):
            if (sb.dir / "api.sock").exists():
                return sb
            await asyncio.sleep(0.01)
        await self.destroy(sb)
        raise BackendFailure("firecracker did not open its API socket within 5 s")

    async def create(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        sb = await self._spawn(sandbox_id, image, limits, env)
        vm_files = image.rootfs.parent / "firecracker"
        try:
            await _clone_file(vm_files / "rootfs.ext4", sb.dir / "rootfs.ext4")
            await self._api(sb, "PUT", "/machine-config", {
                "vcpu_count": max(1, limits.cpu_millis // 1000), "mem_size_mib": limits.memory_bytes >> 20,
                "track_dirty_pages": True})
            await self._api(sb, "PUT", "/boot-source", {
                "kernel_image_path": str(vm_files / "vmlinux"), "boot_args": BOOT_ARGS})
            await self._api(sb, "PUT", "/drives/rootfs", {
                "drive_id": "rootfs", "path_on_host": str(sb.dir / "rootfs.ext4"), "is_root_device": True,
                "is_read_only": False})
            await self._api(sb, "PUT", "/vsock", {"guest_cid": GUEST_CID, "uds_path": str(sb.dir / "v.sock")})
            await self._api(sb, "PUT", "/actions", {"action_type": "InstanceStart"})
        except BaseException:
            await self.destroy(sb)
            raise
        return sb

    async def exec(self, sb: SandboxHandle, spec: ExecSpec) -> AsyncIterator[ExecChunk]:
        reader, writer = await asyncio.open_unix_connection(str(sb.dir / "v.sock"))
        try:
            writer.write(f"CONNECT {AGENT_PORT}\n".encode())  # Firecracker's host-initiated vsock handshake
            await writer.drain()
            if not (await reader.readline()).startswith(b"OK"):
                raise BackendFailure("guest agent did not accept the vsock connection")
            request = {"argv": spec.argv, "cwd": spec.cwd, "env": {**sb.env, **spec.env},
                       "stdin": base64.b64encode(spec.stdin).decode(), "background": spec.background,
                       "timeout_s": spec.timeout_s}
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            while line := await asyncio.wait_for(reader.readline(), spec.timeout_s + 5):
                msg = json.loads(line)
                if "exit" in msg:
                    yield ExecChunk(exit_code=msg["exit"])
                    return
                yield ExecChunk(stdout=base64.b64decode(msg.get("stdout", "")),
                                stderr=base64.b64decode(msg.get("stderr", "")))
            yield ExecChunk(exit_code=TIMEOUT_EXIT_CODE)
        finally:
            writer.close()

    async def pause(self, sb: SandboxHandle) -> None:
        await self._api(sb, "PATCH", "/vm", {"state": "Paused"})
        sb.paused = True

    async def resume(self, sb: SandboxHandle) -> None:
        await self._api(sb, "PATCH", "/vm", {"state": "Resumed"})
        sb.paused = False

    async def snapshot(self, sb: SandboxHandle, snapshot_id: str, dest: Path) -> SnapshotRef:
        dest.mkdir(parents=True, exist_ok=True)
        parent: Path | None = sb.state.get("last_memory")
        was_paused = sb.paused
        if not was_paused:
            await self.pause(sb)
        try:
            kind = "Diff" if parent is not None else "Full"
            await self._api(sb, "PUT", "/snapshot/create", {
                "snapshot_type": kind, "snapshot_path": str(dest / "vmstate"), "mem_file_path": str(dest / "mem")})
            await _clone_file(sb.dir / "rootfs.ext4", dest / "rootfs.ext4")
        finally:
            if not was_paused:
                await self.resume(sb)
        if parent is not None and parent.exists():
            await _layer_diff(parent, dest / "mem")
        sb.state["last_memory"] = dest / "mem"
        return SnapshotRef(snapshot_id, self.name, dest, sb.image.name, sb.limits, sb.env, memory=True)

    async def restore(self, ref: SnapshotRef, sandbox_id: str, image: Image) -> SandboxHandle:
        # The saved VM state names its drive by path: a jailer chroot per VM keeps that path identical for
        # every copy; without the jailer the copy is placed where the snapshot's drive was.
        sb = await self._spawn(sandbox_id, image, ref.limits, ref.env)
        try:
            await _clone_file(ref.dir / "rootfs.ext4", sb.dir / "rootfs.ext4")
            await self._api(sb, "PUT", "/snapshot/load", {
                "snapshot_path": str(ref.dir / "vmstate"),
                "mem_backend": {"backend_type": "File", "backend_path": str(ref.dir / "mem")},
                "enable_diff_snapshots": True, "resume_vm": True})
        except BaseException:
            await self.destroy(sb)
            raise
        return sb

    async def fork(self, sb: SandboxHandle, sandbox_ids: list[str]) -> list[SandboxHandle]:
        staging = sb.dir / f"fork-{sb.state['generation']}"
        sb.state["generation"] += 1
        ref = await self.snapshot(sb, staging.name, staging)
        # The forks keep mapping `staging/mem`; it is removed with the parent sandbox's directory.
        return await start_all(self, [self.restore(ref, i, sb.image) for i in sandbox_ids])

    async def destroy(self, sb: SandboxHandle) -> None:
        proc = sb.state.get("proc")
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(sb.dir, ignore_errors=True)

    def memory_bytes(self, sb: SandboxHandle) -> int:
        proc = sb.state.get("proc")
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (AttributeError, FileNotFoundError):
            pass
        return 0


async def _clone_file(source: Path, dest: Path) -> None:
    """A reflink where the filesystem has them (XFS, btrfs), else a sparse copy."""
    proc = await asyncio.create_subprocess_exec("cp", "--reflink=auto", "--sparse=always", str(source), str(dest))
    if await proc.wait() != 0:
        raise BackendFailure(f"cannot copy {source} to {dest}")


async def _layer_diff(parent_mem: Path, diff_mem: Path) -> None:
    """Turns a sparse Diff memory file into a full one: parent's pages, overwritten by the diff's data."""
    merged = diff_mem.with_suffix(".merged")
    await _clone_file(parent_mem, merged)
    await asyncio.to_thread(_copy_data_extents, diff_mem, merged)
    os.replace(merged, diff_mem)


def _copy_data_extents(source: Path, dest: Path) -> None:
    with open(source, "rb") as src, open(dest, "r+b") as dst:
        fd, end, offset = src.fileno(), os.fstat(src.fileno()).st_size, 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                return
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            src.seek(start)
            dst.seek(start)
            dst.write(src.read(stop - start))
            offset = stop
