"""The gateway service: OpenAI-compatible HTTP plus k3.v1.GatewayService over gRPC."""

from __future__ import annotations

from aiohttp import web

from k3.v1 import gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.frontend import Frontend
from services.gateway.grpc_api import GatewayServicer
from services.gateway.http_api import build_app
from services.gateway.peers import Peers
from services.gateway.pipeline import Pipeline
from services.runtime import ServiceApp
from services.runtime.registry import Watcher


def main(argv: list[str]) -> None:
    config = GatewayConfig.load("gateway", argv)
    app = ServiceApp("gateway", config)
    endpoints = config.etcd_endpoint_list()
    peers = Peers(Watcher(endpoints, config.etcd_prefix) if endpoints else None,
                  {"router": config.router_address, "admission": config.admission_address}, config.auth_token)
    pipeline = Pipeline(peers, config.max_attempts, config.request_timeout_s, config.resume_mid_stream,
                        config.route_wait_s, config.hash_block_tokens)
    frontend = Frontend(pipeline, config.model, config.max_prompt_tokens)
    app.add_service(gateway_pb2_grpc.add_GatewayServiceServicer_to_server,
                    GatewayServicer(frontend, config.max_output_tokens), "k3.v1.GatewayService")
    runner = web.AppRunner(build_app(frontend, config.max_output_tokens, app.tracker, config.auth_token))

    async def start_http() -> None:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.http_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        app.meta["http_address"] = f"{config.host}:{port}"

    async def stop_http() -> None:
        await runner.cleanup()
        await peers.close()

    app.on_start(start_http)
    app.on_stop(stop_http)
    app.run()
