"""Per-sandbox root filesystem: a size-capped tmpfs holding an overlayfs upper layer over a shared image.

The tmpfs size is the sandbox's disk limit (a disk filler gets ENOSPC) and its pages are charged to the
sandbox's memory cgroup by whoever writes them, so disk cannot be used to dodge the memory limit either.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
from pathlib import Path

from services.sandbox.errors import BackendFailure

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_NOSUID = 0x2
_MS_NODEV = 0x4


def mount(source: str, target: Path, fstype: str, flags: int = 0, data: str = "") -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode() or None) != 0:
        err = ctypes.get_errno()
        raise BackendFailure(f"mount {fstype} on {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    if os.path.ismount(target) and _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise BackendFailure(f"umount {target}: {os.strerror(err)}")


async def copy_tree(source: Path, dest: Path) -> None:
    """cp -a keeps overlay whiteouts (0:0 char devices) and opaque-dir xattrs, which shutil does not."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", f"{source}/.", str(dest), stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise BackendFailure(f"copy {source} -> {dest}: {err.decode(errors='replace').strip()}")


class OverlayDisk:
    def __init__(self, sandbox_dir: Path, lower: Path, size_bytes: int) -> None:
        self.disk = sandbox_dir / "disk"
        self.upper = self.disk / "upper"
        self.merged = sandbox_dir / "rootfs"
        self.lower = lower
        self.size_bytes = size_bytes

    async def mount(self, seed_upper: Path | None = None) -> None:
        """Mounts the tmpfs and overlay; `seed_upper` is a saved upper layer (snapshot or fork parent)."""
        self.disk.mkdir(parents=True, exist_ok=True)
        self.merged.mkdir(parents=True, exist_ok=True)
        mount("tmpfs", self.disk, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={self.size_bytes},mode=0755")
        try:
            if seed_upper is not None:
                await copy_tree(seed_upper, self.upper)
            self.upper.mkdir(exist_ok=True)
            (self.disk / "work").mkdir(exist_ok=True)
            options = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.disk / 'work'}"
            mount("overlay", self.merged, "overlay", _MS_NODEV, options)
        except BaseException:
            unmount(self.disk)
            raise

    async def save_upper(self, dest: Path) -> None:
        await copy_tree(self.upper, dest)

    def used_bytes(self) -> int:
        st = os.statvfs(self.disk)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def unmount(self) -> None:
        unmount(self.merged)
        unmount(self.disk)
        shutil.rmtree(self.merged, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)
