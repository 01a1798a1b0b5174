"""Prometheus metrics shared by every service: RPC counts, latency and in-flight calls.

Services define their own metrics with prometheus_client at module level; all land in the default
registry, which the runtime serves on `metrics_port` at /metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPC_REQUESTS = Counter("k3_rpc_requests_total", "gRPC calls handled", ["service", "method", "code"])
RPC_LATENCY = Histogram(
    "k3_rpc_latency_seconds",
    "gRPC call duration (streams: until the last message)",
    ["service", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RPC_IN_FLIGHT = Gauge("k3_rpc_in_flight", "gRPC calls in progress", ["service"])
SERVICE_UP = Gauge("k3_service_up", "1 while serving, 0 while draining", ["service", "instance", "cluster"])
REGISTRY_CONNECTED = Gauge("k3_registry_connected", "1 while etcd membership is live", ["service"])


def serve_metrics(host: str, port: int) -> int:
    """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_address[1]
