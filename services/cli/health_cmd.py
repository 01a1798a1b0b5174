"""`k3 health --address HOST:PORT [--service NAME]`: exit 0 when the server reports SERVING."""

from __future__ import annotations

import argparse
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The health status name, or UNREACHABLE."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3 health")
    parser.add_argument("--address", default=os.environ.get("K3_HEALTH_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1
