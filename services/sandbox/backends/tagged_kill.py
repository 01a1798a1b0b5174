"""Killing one command's tasks in a runc container, where a command gets no cgroup of its own: its tasks
are found by a tag in their environment, which every descendant inherits, re-parented or not."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from services.sandbox.backends.base import SandboxBackend, SandboxHandle
from services.sandbox.backends.launch import frozen


def tagged_pids(procs_file: Path, tag: bytes) -> list[int]:
    """The tasks listed in `procs_file` (a cgroup.procs) whose environment holds `tag` (b"NAME=value")."""
    try:
        pids = procs_file.read_text().split()
    except FileNotFoundError:
        return []
    found = []
    for pid in pids:
        try:
            if tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


async def terminate_tagged(backend: SandboxBackend, sb: SandboxHandle, procs_file: Path, tag: bytes,
                           grace_s: float) -> None:
    """SIGTERM every tagged task, then SIGKILL the rest with the sandbox frozen: freezing first stops a fork
    bomb from outrunning the kill."""
    _signal_all(tagged_pids(procs_file, tag), signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while tagged_pids(procs_file, tag) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    if not tagged_pids(procs_file, tag):
        return
    async with frozen(backend, sb):
        _signal_all(tagged_pids(procs_file, tag), signal.SIGKILL)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
