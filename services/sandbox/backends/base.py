"""The contract every sandbox backend implements, and the plain records passed across it."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.errors import InvalidRequest, WrongState
from services.sandbox.images import Image

SANDBOX_UID = 1000  # commands run as this unprivileged user ("user", home /home/user), as E2B does
SANDBOX_HOME = "/home/user"


@dataclass(frozen=True)
class Capabilities:
    memory_snapshot: bool  # snapshots carry process memory, not just files
    incremental: bool  # snapshots store only pages dirtied since the previous one
    live_fork: bool  # forks continue running processes from the parent's exact state
    hibernate: bool = False  # pause can release the sandbox's memory (state kept on disk until resume)


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_millis: int
    pids: int
    disk_bytes: int
    wall_clock_s: int  # hard cap on the run time of any one command
    network: bool = False


@dataclass
class ExecSpec:
    argv: list[str]
    stdin: bytes = b""
    timeout_s: float = 60.0
    cwd: str = SANDBOX_HOME
    env: dict[str, str] = field(default_factory=dict)
    background: bool = False  # detach (double fork, stdio to a log) and return at once


@dataclass
class ExecChunk:
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = None  # set on the last chunk only


@dataclass
class SandboxHandle:
    """What a backend knows about one live sandbox; `state` holds backend-specific objects."""

    sandbox_id: str
    image: Image
    limits: Limits
    env: dict[str, str]
    dir: Path
    paused: bool = False
    hibernated: bool = False  # paused with its memory released; resume brings it back
    state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotRef:
    snapshot_id: str
    backend: str
    dir: Path
    image: str
    limits: Limits
    env: dict[str, str]
    memory: bool


async def collect(chunks: AsyncIterator[ExecChunk]) -> ExecChunk:
    """Joins a streamed exec into one chunk."""
    out, err, code = bytearray(), bytearray(), None
    async for chunk in chunks:
        out += chunk.stdout
        err += chunk.stderr
        if chunk.exit_code is not None:
            code = chunk.exit_code
    return ExecChunk(bytes(out), bytes(err), code)


class SandboxBackend(abc.ABC):
    name: str
    capabilities: Capabilities

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> str | None:
        """None when the backend can run on this host, else the reason it cannot."""

    @abc.abstractmethod
    async def create(self, sandbox_id: str, image: Image, limits: Limits, env: dict[str, str]) -> SandboxHandle:
        ...

    @abc.abstractmethod
    def exec(self, sb: SandboxHandle, spec: ExecSpec) -> AsyncIterator[ExecChunk]:
        """Streams output; the last chunk carries the exit code (124 when the command ran past its time)."""

    @abc.abstractmethod
    async def pause(self, sb: SandboxHandle) -> None:
        ...

    @abc.abstractmethod
    async def resume(self, sb: SandboxHandle) -> None:
        """Resumes a paused or a hibernated sandbox."""

    async def hibernate(self, sb: SandboxHandle) -> None:
        """Pauses and releases the sandbox's memory; only for backends with `capabilities.hibernate`."""
        raise WrongState(f"the {self.name} backend cannot release memory on pause")

    @abc.abstractmethod
    async def snapshot(self, sb: SandboxHandle, snapshot_id: str, dest: Path) -> SnapshotRef:
        ...

    @abc.abstractmethod
    async def restore(self, ref: SnapshotRef, sandbox_id: str, image: Image) -> SandboxHandle:
        ...

    @abc.abstractmethod
    async def fork(self, sb: SandboxHandle, sandbox_ids: list[str]) -> list[SandboxHandle]:
        ...

    @abc.abstractmethod
    async def destroy(self, sb: SandboxHandle) -> None:
        ...

    @abc.abstractmethod
    def memory_bytes(self, sb: SandboxHandle) -> int:
        ...

    def release_host_state(self) -> None:
        """Removes what the backend set up on the host for all its sandboxes (called once all are gone)."""
        return None

    async def reap_orphans(self) -> list[str]:
        """Destroys sandboxes a previous manager process left behind (mounts, cgroups, processes)."""
        return []

    async def read_file(self, sb: SandboxHandle, path: str) -> bytes:
        """Reads inside the sandbox as its user, so symlinks planted by the tenant cannot reach the host."""
        result = await collect(self.exec(sb, ExecSpec(argv=["cat", "--", path], timeout_s=30)))
        if result.exit_code != 0:
            raise InvalidRequest("path", result.stderr.decode(errors="replace").strip() or f"cannot access {path}")
        return result.stdout

    async def write_file(self, sb: SandboxHandle, path: str, data: bytes, mode: int) -> int:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        spec = ExecSpec(argv=["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=data, timeout_s=30)
        result = await collect(self.exec(sb, spec))
        if result.exit_code != 0:
            raise InvalidRequest("path", result.stderr.decode(errors="replace").strip() or f"cannot access {path}")
        return len(data)
