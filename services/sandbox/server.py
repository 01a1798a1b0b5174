"""The sandbox manager process: `k3 serve sandbox [--flags]` (gRPC, plus the E2B-style REST facade)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from k3.v1 import sandbox_pb2_grpc
from services.runtime import ServiceApp
from services.sandbox.backends.registry import available_backends
from services.sandbox.config import SandboxConfig
from services.sandbox.manager import SandboxManager
from services.sandbox.rest import rest_app
from services.sandbox.service import SandboxServicer


def main(argv: list[str]) -> None:
    config = SandboxConfig.load("sandbox", argv)
    backends = available_backends(Path(config.root_dir) / "backends")
    if config.default_backend not in backends:
        raise SystemExit(f"sandbox: default backend {config.default_backend!r} cannot run on this host; "
                         f"available: {', '.join(backends) or 'none'}")
    manager = SandboxManager(config, backends)
    app = ServiceApp("sandbox", config)
    app.add_service(sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, SandboxServicer(manager),
                    "k3.v1.SandboxService")
    runner: web.AppRunner | None = None

    async def start() -> None:
        nonlocal runner
        manager.images.ensure_base()
        await manager.start()
        app.meta["backends"] = sorted(backends)
        if config.rest_port >= 0:
            runner = web.AppRunner(rest_app(manager))
            await runner.setup()
            site = web.TCPSite(runner, config.host, config.rest_port)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # the chosen port when rest_port is 0
            app.meta["rest_address"] = f"{config.host}:{port}"

    async def stop() -> None:
        if runner is not None:
            await runner.cleanup()
        await manager.close()

    app.on_start(start)
    app.on_stop(stop)
    app.run()
