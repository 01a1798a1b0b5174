"""The router servicer in-process with a controllable clock: the failback hold-down, weights, unreachable
decode workers (real sockets to closed ports), and the no-fleet / no-healthy-cluster errors."""

from __future__ import annotations

import pytest

from k3.v1 import common_pb2, router_pb2
from services.router.assignment_store import AssignmentStore
from services.router.config import RouterConfig
from services.router.service import RouterServicer
from services.runtime import errors
from services.runtime.client import ChannelPool
from services.runtime.ports import free_port
from services.runtime.registry import InstanceRecord


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decode(cluster: str) -> InstanceRecord:
    # A free port nobody listens on: the probe fails fast and the router must fall back.
    return InstanceRecord("decode", cluster, f"{cluster}-d0", f"127.0.0.1:{free_port()}", region="eu")


def request(session: str) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(session=common_pb2.SessionRef(session_id=session), block_hashes=[1, 2])


async def test_failback_waits_for_the_hold_and_weights_are_reported():
    clock = Clock()
    config = RouterConfig(failback_hold_s=5, slot_bits=10, cluster_weights={"a": 3.0}, probe_timeout_ms=200)
    channels = ChannelPool()
    router = RouterServicer(config, channels, clock)
    with pytest.raises(errors.Unavailable, match="no cluster"):
        await router.Route(request("s"), None)
    records = [decode(c) for c in "abc"]
    router.apply_membership(records)
    await router.wait_ready()
    fleet = await router.GetFleet(router_pb2.GetFleetRequest(), None)
    assert {c.cluster.name: c.weight for c in fleet.clusters} == {"a": 3.0, "b": 1.0, "c": 1.0}
    session = next(s for s in (f"s{i}" for i in range(100)) if router.table.place(s).primary == "a")
    first = await router.Route(request(session), None)
    assert first.target.name == "a" and first.decode.instance == "a-d0" and first.expected_hit_tokens == 0

    clock.now = 1
    router.apply_membership(records[1:])
    clock.now = 1 + config.mass_loss_settle_s  # a loss takes effect once it has settled (damping.py)
    router.tick()
    moved = await router.Route(request(session), None)
    assert moved.failover and moved.target == first.backup and moved.primary.region == "eu"

    clock.now = 10
    router.apply_membership(records)
    held = await router.Route(request(session), None)
    assert held.failover and held.target == first.backup
    fleet = await router.GetFleet(router_pb2.GetFleetRequest(), None)
    assert [c.cluster.name for c in fleet.clusters if c.held_down] == ["a"]
    clock.now = 15
    router.tick()
    back = await router.Route(request(session), None)
    assert not back.failover and back.target.name == "a"

    router.apply_membership([])  # every cluster at once: damped (damping.py) for 2 x lease TTL, then gone
    assert (await router.Route(request(session), None)).target.name == "a"
    clock.now = 15 + 2 * config.lease_ttl_s
    router.tick()
    with pytest.raises(errors.Unavailable, match="no healthy cluster"):
        await router.Route(request(session), None)
    await channels.close()


def healthy_fleet(clusters: str) -> list[InstanceRecord]:
    return [decode(c) for c in clusters]


async def test_bounded_mode_keeps_stored_pairs_when_the_fleet_grows(etcd_server):
    store = AssignmentStore([etcd_server], f"/k3test-grow-{free_port()}", 0.1, 600, 60)
    config = RouterConfig(slot_bits=10, placement_mode="bounded", probe_timeout_ms=200)
    channels = ChannelPool()
    router = RouterServicer(config, channels, Clock(), assignments=store)
    try:
        assert store.wait_synced(10)
        router.apply_membership(healthy_fleet("abcd"))
        await router.wait_ready()
        sessions = [f"grow-{i}" for i in range(60)]
        before = {s: await router.Route(request(s), None) for s in sessions}
        assert all((store.get(s).primary, store.get(s).backup) == (r.primary.name, r.backup.name)
                   for s, r in before.items())
        router.apply_membership(healthy_fleet("abcde"))
        await router.wait_ready()
        assert router.table.clusters == ["a", "b", "c", "d", "e"]
        for s in sessions:  # stored sessions keep their pair and their target: nothing moves
            after = await router.Route(request(s), None)
            assert (after.primary, after.backup, after.target) == (before[s].primary, before[s].backup,
                                                                   before[s].target)
        # New sessions follow the grown table's primary; some now land on the new cluster.
        fresh = [await router.Route(request(f"new-{i}"), None) for i in range(60)]
        assert [r.primary.name for r in fresh] == [router.table.place(f"new-{i}").primary for i in range(60)]
        assert any(r.primary.name == "e" for r in fresh)
    finally:
        store.close()
        await channels.close()


async def test_bounded_mode_routes_from_the_mirror_and_statelessly_while_etcd_is_down(etcd_restartable):
    store = AssignmentStore([etcd_restartable.endpoint], "/k3test-down", 0.1, 600, 60)
    channels = ChannelPool()
    router = RouterServicer(RouterConfig(slot_bits=10, placement_mode="bounded", probe_timeout_ms=200), channels,
                            Clock(), assignments=store)
    try:
        assert store.wait_synced(10)
        router.apply_membership(healthy_fleet("abcdef"))
        await router.wait_ready()
        # Enough sessions of one primary that some backups differ from the stateless second choice.
        known = {s: await router.Route(request(s), None) for s in (f"k{i}" for i in range(150))}
        etcd_restartable.stop()
        for s, before in known.items():  # known sessions: the stored pair, from the mirror
            after = await router.Route(request(s), None)
            assert (after.primary, after.backup, after.target) == (before.primary, before.backup, before.target)
        assert any(r.backup.name != router.table.place(s).backup for s, r in known.items())
        for s in ("new-1", "new-2"):  # new sessions: the stateless pair, not stored
            answer = await router.Route(request(s), None)
            expected = router.table.place(s)
            assert (answer.primary.name, answer.backup.name, answer.target.name) == (
                expected.primary, expected.backup, expected.primary)
            assert store.get(s) is None
    finally:
        store.close()
        await channels.close()
