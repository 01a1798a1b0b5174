"""Pieces shared by the local Linux backends: host tool checks, cgroup joining, command environment."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Coroutine

from services.sandbox.backends.base import SANDBOX_HOME, SandboxBackend, SandboxHandle

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": SANDBOX_HOME,
    "USER": "user",
    "LANG": "C.UTF-8",
}
# The launcher writes its own pid into each cgroup.procs file before exec'ing the real command: the command
# is born inside the sandbox's cgroups, with no window in which it runs unlimited.
_JOIN_SCRIPT = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n-1)); done; exec "$@"'


def require_tools(*tools: str) -> str | None:
    missing = [t for t in tools if shutil.which(t) is None]
    return f"missing host tools: {', '.join(missing)} (run .ci/install-sandbox-deps.sh)" if missing else None


def join_cgroups_argv(procs_files: list[str], argv: list[str]) -> list[str]:
    return ["/bin/sh", "-c", _JOIN_SCRIPT, "sh", str(len(procs_files)), *procs_files, *argv]


def background_argv(argv: list[str], tag: str) -> list[str]:
    """Detaches a command: `setsid -f` forks inside the sandbox's pid namespace, so when the launcher exits
    the command is re-parented to the sandbox's init (and is part of its checkpointable process tree), and its
    stdio points at files inside the sandbox rather than at the host's pipes."""
    redirect = f'exec "$@" </dev/null >>/tmp/.bg-{tag}.log 2>&1'
    return ["setsid", "-f", "sh", "-c", redirect, "sh", *argv]


def command_env(sandbox_env: dict[str, str], exec_env: dict[str, str]) -> dict[str, str]:
    return {**BASE_ENV, **sandbox_env, **exec_env}


class frozen:
    """Freezes a running sandbox for the body (a consistent copy of its state); leaves a paused one paused."""

    def __init__(self, backend: SandboxBackend, sb: SandboxHandle) -> None:
        self.backend, self.sb, self.was_paused = backend, sb, sb.paused

    async def __aenter__(self) -> None:
        if not self.was_paused:
            await self.backend.pause(self.sb)

    async def __aexit__(self, *exc: object) -> None:
        if not self.was_paused:
            await self.backend.resume(self.sb)


async def gather_all(*aws: Coroutine) -> list:
    """Runs all concurrently and waits for every one even when one fails (so nothing is still running behind
    the error), then raises the first failure."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def start_all(backend: SandboxBackend, starts: list[Coroutine]) -> list[SandboxHandle]:
    """Starts copies concurrently; if any fails, the ones that started are destroyed so nothing leaks."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for r in results:
            if isinstance(r, SandboxHandle):
                await backend.destroy(r)
        raise failures[0]
    return list(results)
