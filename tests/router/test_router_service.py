"""The router as real processes over a real etcd: replicas agree, the prefix holder wins, a SIGKILLed
cluster's sessions move to their pre-assigned backups within the lease TTL, and come back when it returns."""

from __future__ import annotations

import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from k3.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.placement import PlacementTable
from services.runtime.client import sync_channel
from tests.support.processes import ServiceProcess
from tests.support.repeated_calls import RepeatedCalls

CLUSTERS = ("c0", "c1", "c2")
SLOT_BITS = 12
TTL_S = 1
SESSIONS = [f"session-{i}" for i in range(120)]


class Fleet:
    def __init__(self, etcd: str, workdir):
        self.etcd, self.workdir = etcd, workdir
        self.prefix = f"/k3test-{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, ServiceProcess] = {}

    def common(self) -> list[str]:
        return ["--port", "0", "--metrics-port", "-1", "--etcd-endpoints", self.etcd,
                "--etcd-prefix", self.prefix, "--lease-ttl-s", str(TTL_S)]

    def decode(self, cluster: str, index: int, hit_tokens: int, running: int) -> ServiceProcess:
        name = f"{cluster}-d{index}"
        return self._proc(name, ["serve", "tests.router.standin_decode", *self.common(), "--cluster", cluster,
                                 "--instance", name, "--hit-tokens", str(hit_tokens), "--running", str(running)])

    def router(self, index: int) -> ServiceProcess:
        return self._proc(f"router-{index}", ["serve", "router", *self.common(), "--cluster", "global",
                                              "--slot-bits", str(SLOT_BITS), "--probe-timeout-ms", "1000"])

    def _proc(self, name: str, args: list[str]) -> ServiceProcess:
        self.procs[name] = ServiceProcess(args, self.workdir / f"{name}-{time.monotonic_ns()}")
        return self.procs[name]

    def start(self, procs: list[ServiceProcess]) -> None:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.start(), procs))

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()


@pytest.fixture(scope="module")
def fleet(etcd_server, tmp_path_factory):
    f = Fleet(etcd_server, tmp_path_factory.mktemp("router-fleet"))
    decodes = [f.decode(c, 0, hit_tokens=0, running=5) for c in CLUSTERS]
    # c1 has a second worker holding a 1024-token prefix but busier: the prefix must win over load.
    decodes.append(f.decode("c1", 1, hit_tokens=1024, running=9))
    try:
        f.start(decodes + [f.router(0), f.router(1)])
        f.stubs = [router_pb2_grpc.RouterServiceStub(sync_channel(f.procs[f"router-{i}"].address))
                   for i in range(2)]
        wait_for(lambda: all(healthy(s) == set(CLUSTERS) for s in f.stubs), 15, "routers to see 3 clusters")
        yield f
    finally:
        f.stop()


def healthy(stub) -> set[str]:
    return {c.cluster.name for c in stub.GetFleet(router_pb2.GetFleetRequest()).clusters if c.healthy}


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def route(stub, session: str, **kwargs) -> router_pb2.RouteResponse:
    return stub.Route(router_pb2.RouteRequest(session=common_pb2.SessionRef(session_id=session), **kwargs),
                      timeout=5)


def test_replicas_agree_with_the_reference_placement(fleet):
    oracle = PlacementTable(dict.fromkeys(CLUSTERS, 1.0), slot_bits=SLOT_BITS)
    for session in SESSIONS:
        a, b = (route(stub, session) for stub in fleet.stubs)
        assert a == b
        expected = oracle.place(session)
        assert (a.primary.name, a.backup.name, a.target.name) == (expected.primary, expected.backup,
                                                                   expected.primary)
        assert a.primary.name != a.backup.name and not a.failover
        assert a.decode.cluster == a.target.name and a.decode.address


def test_decode_worker_with_the_prefix_wins_else_least_loaded(fleet):
    session = next(s for s in SESSIONS if route(fleet.stubs[0], s).target.name == "c1")
    hit = route(fleet.stubs[0], session, block_hashes=[11, 22, 33], hash_block_tokens=512)
    assert (hit.decode.instance, hit.expected_hit_tokens) == ("c1-d1", 1024)
    cold = route(fleet.stubs[0], session)
    assert (cold.decode.instance, cold.expected_hit_tokens) == ("c1-d0", 0)


def test_empty_session_id_is_rejected_naming_the_field(fleet):
    with pytest.raises(grpc.RpcError) as err:
        route(fleet.stubs[0], "")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session.session_id" in err.value.details()


def test_killed_cluster_fails_over_to_backups_and_fails_back(fleet):
    before = {s: route(fleet.stubs[0], s) for s in SESSIONS}
    moved = [s for s, r in before.items() if r.primary.name == "c0"]
    assert moved and len({before[s].backup.name for s in moved}) == 2  # c0's sessions spread over both
    # 100 sessions routed continuously from 8 threads over both replicas.
    with RepeatedCalls(lambda i: route(fleet.stubs[i % 2], SESSIONS[i % 100]), threads=8) as load:
        fleet.procs["c0-d0"].signal(signal.SIGKILL)
        noticed = wait_for(lambda: all("c0" not in healthy(s) for s in fleet.stubs), TTL_S + 5,
                           "c0 to drop out")
    print(f"router noticed the SIGKILL after {noticed:.2f} s (lease TTL {TTL_S} s); "
          f"{len(load.answers)} routes answered under load meanwhile")
    # Routing never failed while the cluster died (its sessions just kept their target until the lease went).
    assert load.errors == [] and load.answers
    for session, old in before.items():
        new = [route(stub, session) for stub in fleet.stubs]
        assert new[0] == new[1]
        assert (new[0].primary, new[0].backup) == (old.primary, old.backup)
        if old.primary.name == "c0":
            assert new[0].target == old.backup and new[0].failover
        else:
            assert new[0].target == old.target and not new[0].failover
    # The primary returns: new turns go back to it (failback_hold_s = 0).
    fleet.start([fleet.decode("c0", 0, hit_tokens=0, running=0)])
    wait_for(lambda: all(healthy(s) == set(CLUSTERS) for s in fleet.stubs), 15, "c0 to return")
    for session, old in before.items():
        again = route(fleet.stubs[1], session)
        assert again.target == old.target and not again.failover
