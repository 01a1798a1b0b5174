"""A real TCP proxy on loopback that damages the first connection through it, for fault-injection tests.

`flip_after` flips one byte inside the first occurrence of `marker` in the chosen direction (the bytes
reach the peer corrupted, framing intact); `cut_after` closes the first connection once that many bytes
went upstream (a broken stream). Later connections pass through untouched.
"""

from __future__ import annotations

import asyncio


class FaultyProxy:
    def __init__(self, target: str, *, marker: bytes = b"", downstream: bool = False, cut_after: int = 0):
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.marker = marker
        self.downstream = downstream
        self.cut_after = cut_after
        self.connections = 0
        self.flipped = False
        self.cut = False
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, client_reader, client_writer) -> None:
        self.connections += 1
        damaged = self.connections == 1
        server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        up = self._pump(client_reader, server_writer, damaged and not self.downstream, damaged, client_writer)
        down = self._pump(server_reader, client_writer, damaged and self.downstream, False, server_writer)
        await asyncio.gather(up, down, return_exceptions=True)

    async def _pump(self, reader, writer, corrupt: bool, may_cut: bool, other_writer) -> None:
        tail, sent = b"", 0
        try:
            while data := await reader.read(65536):
                if corrupt and self.marker and not self.flipped:
                    window = tail + data
                    at = window.find(self.marker)
                    if at >= 0:
                        position = at - len(tail) + len(self.marker) // 2
                        if position >= 0:
                            data = data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1:]
                            self.flipped = True
                    tail = window[-len(self.marker):]
                sent += len(data)
                if may_cut and self.cut_after and not self.cut and sent >= self.cut_after:
                    self.cut = True
                    writer.write(data[: len(data) - (sent - self.cut_after)])
                    raise ConnectionResetError("proxy cut the stream")
                writer.write(data)
                await writer.drain()
        finally:
            for w in (writer, other_writer):
                w.close()
