"""Mid-stream failover, for real: a 2-cluster local fleet streams a greedy completion from the session's
primary; after the first chunk every process of the primary is SIGKILLed. The gateway resumes on the
pre-assigned backup (re-prefilling the prompt plus the tokens already sent) and the client sees one
uninterrupted stream whose tokens equal those of the same request served without a fault."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from k3.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, router_pb2, router_pb2_grpc
from tests.fleet.k3cli import logs, running_fleet, state
from tests.support.metrics import scrape

pytest.importorskip("services.decode.server")

PROMPT = "Resume me on the backup: "
SAMPLING = common_pb2.SamplingParams(temperature=0, top_p=1.0, max_tokens=48)


def session_on(router: str, primary: str) -> str:
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for i in range(100):
            reply = stub.Route(router_pb2.RouteRequest(session=common_pb2.SessionRef(session_id=f"resume-{i}")),
                               timeout=10)
            if reply.primary.name == primary:
                return f"resume-{i}"
    raise AssertionError(f"no session placed on {primary}")


async def stream(gateway: str, session: str, on_first_chunk=None) -> tuple[list[int], list[str]]:
    tokens, clusters = [], []
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        async for reply in stub.Complete(gateway_pb2.CompleteRequest(
                model="nano", prompt=PROMPT, sampling=SAMPLING, session=common_pb2.SessionRef(session_id=session)),
                timeout=120):
            if reply.chunk.token_ids and on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
            tokens.extend(reply.chunk.token_ids)
            if reply.cluster and (not clusters or clusters[-1] != reply.cluster):
                clusters.append(reply.cluster)
    return tokens, clusters


def failovers(metrics_address: str, stage: str) -> float:
    """0 until the first failover at `stage` creates the labelled series."""
    return scrape(metrics_address, timeout=5).get("k3_gateway_failovers_total", {"stage": stage}, 0.0)


def test_a_stream_resumes_on_the_backup_when_its_cluster_dies(tmp_path):
    home = tmp_path / "k3home"
    with running_fleet(home, "--clusters", "2", "--lease-ttl-s", "2", "--no-smoke"):
        fleet_state = state(home)
        gateway = next(m for m in fleet_state.members if m.service == "gateway")
        router = next(m for m in fleet_state.members if m.service == "router")
        session = session_on(router.address, "c1")
        expected, clusters = asyncio.run(stream(gateway.address, session))
        assert clusters == ["c1"] and len(expected) > 8, "the reference run needs a stream long enough to cut"
        victims = [m.pid for m in fleet_state.members if m.cluster == "c1"]
        got, clusters = asyncio.run(stream(gateway.address, session,
                                           lambda: [os.kill(pid, signal.SIGKILL) for pid in victims]))
        try:
            assert clusters == ["c1", "c0"]
            assert got == expected
            assert failovers(gateway.metrics_address, "mid_stream") == 1
        except AssertionError:
            print(logs(home, 3000))
            raise
