"""Two bounded-mode router replicas as real processes (real gRPC servers) over a real etcd: racing on the same
new sessions they answer the same stored pair, and a failed cluster's sessions go to their stored backups
within the per-pair cap.

Cluster membership here is instance records registered by the test under real etcd leases, for decode
workers that do not exist (STAND-IN records: the address is a closed loopback port, so the router's probe
fails at once and it falls back to its rendezvous choice). Which worker serves is not what this file tests.
"""

from __future__ import annotations

import math
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from k3.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.assignment_records import decode
from services.runtime.client import sync_channel
from services.runtime.etcd_follow import connect
from services.runtime.ports import free_port
from services.runtime.registry import InstanceRecord, Registration
from tests.router.test_router_service import healthy, wait_for
from tests.support.processes import ServiceProcess

CLUSTERS = ("c0", "c1", "c2", "c3")
SESSIONS = [f"bounded-{i}" for i in range(160)]


@pytest.fixture(scope="module")
def replicas(etcd_server, tmp_path_factory):
    prefix = f"/k3test-{uuid.uuid4().hex[:8]}"
    registrations = {c: Registration([etcd_server], prefix, InstanceRecord(
        "decode", c, f"{c}-standin", f"127.0.0.1:{free_port()}"), ttl_s=2) for c in CLUSTERS}
    workdir = tmp_path_factory.mktemp("router-bounded")
    procs = [ServiceProcess(["serve", "router", "--port", "0", "--metrics-port", "-1", "--etcd-endpoints",
                             etcd_server, "--etcd-prefix", prefix, "--cluster", "global", "--slot-bits", "12",
                             "--placement-mode", "bounded", "--probe-timeout-ms", "200"], workdir / f"router-{i}")
             for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), procs))
        stubs = [router_pb2_grpc.RouterServiceStub(sync_channel(p.address)) for p in procs]
        wait_for(lambda: all(healthy(s) == set(CLUSTERS) for s in stubs), 15, "routers to see 4 clusters")
        yield stubs, registrations, etcd_server, prefix
    finally:
        for p in procs:
            p.kill()
        for r in registrations.values():
            r.close()


def route(stub, session: str) -> router_pb2.RouteResponse:
    return stub.Route(router_pb2.RouteRequest(session=common_pb2.SessionRef(session_id=session)), timeout=10)


def pair(response: router_pb2.RouteResponse) -> tuple[str, str]:
    return response.primary.name, response.backup.name


def test_replicas_racing_on_new_sessions_agree_then_fail_over_within_the_cap(replicas):
    stubs, registrations, etcd, prefix = replicas
    barrier = threading.Barrier(2)

    def both_at_once(session: str) -> list[tuple[str, str]]:
        def one(stub):
            barrier.wait(timeout=10)
            return pair(route(stub, session))
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(one, stubs))

    answers = {s: both_at_once(s) for s in SESSIONS[:40]}  # each session's two first routes collide
    jobs = [(session, stub) for session in SESSIONS[40:] for stub in stubs]
    with ThreadPoolExecutor(8) as pool:  # and many new sessions in flight at once on both replicas
        for session, answer in pool.map(lambda job: (job[0], pair(route(job[1], job[0]))), jobs):
            answers.setdefault(session, []).append(answer)
    assert all(a == b for a, b in answers.values()), "replicas answered different pairs"
    client = connect([etcd])
    try:
        stored = {m.key.decode().rsplit("/", 1)[1]: decode(v) for v, m in client.get_prefix(f"{prefix}/assign/s/")}
    finally:
        client.close()
    assert {s: (a.primary, a.backup) for s, a in stored.items()} == {s: a for s, (a, _) in answers.items()}

    # Known sessions: the stored pair again, from either replica, without a failover.
    for s in SESSIONS[::7]:
        again = route(stubs[1], s)
        assert pair(again) == answers[s][0] and again.target.name == answers[s][0][0] and not again.failover

    # c0 fails (its lease revoked): its sessions go to their stored backups, within the per-pair cap.
    registrations["c0"].close()
    wait_for(lambda: all("c0" not in healthy(s) for s in stubs), 10, "c0 to drop out")
    moved = [s for s, (p, _) in answers.items() if p[0] == "c0"]
    assert moved
    received = {c: 0 for c in CLUSTERS[1:]}
    for s in moved:
        r = [route(stub, s) for stub in stubs]
        assert r[0].target == r[1].target and r[0].target.name == answers[s][0][1] and r[0].failover
        received[r[0].target.name] += 1
    assert max(received.values()) <= math.ceil(1.1 * len(moved) / (len(CLUSTERS) - 1))


def test_bad_placement_mode_is_rejected_naming_the_field(tmp_path):
    proc = ServiceProcess(["serve", "router", "--port", "0", "--placement-mode", "sticky"], tmp_path / "bad")
    with pytest.raises(RuntimeError, match="placement_mode"):
        proc.start(timeout=30)
    proc.kill()


def test_unknown_session_field_errors_still_name_the_field(replicas):
    stubs = replicas[0]
    with pytest.raises(grpc.RpcError) as err:
        route(stubs[0], "")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session.session_id" in err.value.details()
