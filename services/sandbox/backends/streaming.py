"""Runs the host-side launcher of one sandbox command and streams its output as ExecChunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from services.sandbox.backends.base import ExecChunk

TIMEOUT_EXIT_CODE = 124  # what coreutils `timeout` returns, so agents see a familiar code
_READ_SIZE = 64 * 1024


async def stream_command(
    argv: list[str], stdin: bytes, timeout_s: float, terminate: Callable[[], Awaitable[None]]
) -> AsyncIterator[ExecChunk]:
    """Streams stdout/stderr as they arrive; on timeout (or when the consumer goes away) `terminate` kills
    the command inside the sandbox, since killing the host launcher alone would orphan it there."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    queue: asyncio.Queue[ExecChunk | None] = asyncio.Queue()

    async def pump(reader: asyncio.StreamReader, is_err: bool) -> None:
        while data := await reader.read(_READ_SIZE):
            await queue.put(ExecChunk(stderr=data) if is_err else ExecChunk(stdout=data))
        await queue.put(None)

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()

    tasks = [asyncio.create_task(pump(proc.stdout, False)), asyncio.create_task(pump(proc.stderr, True))]
    if stdin:
        tasks.append(asyncio.create_task(feed()))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    open_streams, timed_out, finished = 2, False, False
    try:
        while open_streams:
            try:
                chunk = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                if timed_out:  # still open after the kill: a detached holder of the pipe; stop waiting
                    proc.kill()
                    break
                timed_out = True
                await terminate()
                deadline = loop.time() + 5.0  # the pipes close once the killed tasks are gone
                continue
            if chunk is None:
                open_streams -= 1
            else:
                yield chunk
        code = await proc.wait()
        finished = True
        yield ExecChunk(exit_code=TIMEOUT_EXIT_CODE if timed_out else _exit_code(code))
    finally:
        if not finished:
            await terminate()
        for t in tasks:
            t.cancel()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _exit_code(returncode: int) -> int:
    # A launcher that re-raises its child's fatal signal shows up as -N; shells report that as 128 + N.
    return 128 - returncode if returncode < 0 else returncode
