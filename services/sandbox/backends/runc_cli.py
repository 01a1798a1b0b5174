"""The runc command line as the CRIU backend drives it: one state directory, one environment, errors that
carry runc's log."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.sandbox.errors import BackendFailure


class RuncCli:
    def __init__(self, state_dir: Path, env: dict[str, str]) -> None:
        self.state_dir = state_dir
        self.env = env

    @property
    def prefix(self) -> list[str]:
        return ["runc", "--root", str(self.state_dir)]

    async def run(self, *args: str, log: Path | None = None) -> None:
        await self.wait(await self.spawn(*args, log=log), args[0], log)

    async def spawn(self, *args: str, log: Path | None = None) -> asyncio.subprocess.Process:
        argv = self.prefix + (["--log", str(log)] if log is not None else [])
        # A detached container inherits runc's stdio: a pipe there would never reach EOF (and CRIU cannot
        # dump a task whose stdio is a host file), so detached commands report through --log only.
        detached = args[0] in ("run", "restore")
        return await asyncio.create_subprocess_exec(
            *argv, *args, env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL if detached else asyncio.subprocess.PIPE,
        )

    @staticmethod
    async def wait(proc: asyncio.subprocess.Process, command: str, log: Path | None) -> None:
        _, err = await proc.communicate()
        if proc.returncode != 0:
            detail = (err or b"").decode(errors="replace").strip()
            if log is not None and log.exists():
                detail += " | " + log.read_text(errors="replace")[-600:]
            raise BackendFailure(f"runc {command} failed: {detail}")
