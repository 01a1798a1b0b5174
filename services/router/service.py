"""k3.v1.RouterService: places sessions on clusters from etcd membership and picks workers inside them.

Replicas agree without talking to each other. Stateless mode: each derives the fleet from the same etcd
records and places sessions with the same pure function of (session, fleet, healthy set). Bounded mode: a
session's (primary, backup) is created once in etcd by a transaction and mirrored by every replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from prometheus_client import Counter, Gauge

from k3.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.assignment_store import ASSIGNMENTS, AssignmentStore
from services.router.config import RouterConfig
from services.router.decision import RouteDecision, decide, decide_assigned
from services.router.membership import ClusterView, FleetTracker, parse_requirements
from services.router.placement import PlacementTable, rendezvous_rank
from services.router.workers import DecodeChooser
from services.runtime import errors
from services.runtime.registry import InstanceRecord

log = logging.getLogger("k3.router")
ROUTES = Counter("k3_router_routes_total", "Routing decisions", ["outcome"])
HEALTHY_CLUSTERS = Gauge("k3_router_healthy_clusters", "Clusters currently receiving traffic")
KNOWN_CLUSTERS = Gauge("k3_router_known_clusters", "Clusters in the placement table")
MEMBERSHIP_DAMPED = Gauge("k3_router_membership_damped",
                          "Clusters kept routable on their last healthy view during a damped mass loss")


def instance_id(record: InstanceRecord | None) -> common_pb2.InstanceId | None:
    if record is None:
        return None
    return common_pb2.InstanceId(service=record.service, cluster=record.cluster, instance=record.instance,
                                 address=record.address)


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, config: RouterConfig, channel_for: Callable[[str], grpc.aio.Channel],
                 clock: Callable[[], float] = time.monotonic, assignments: AssignmentStore | None = None):
        self.config = config
        # Bounded mode's etcd-backed session table; None in stateless mode.
        self.assignments = assignments
        self.clock = clock
        self.damper = config.damper()
        self.fleet = FleetTracker(parse_requirements(config.required_instances), config.forget_after_s,
                                  self.damper)
        self.table: PlacementTable | None = None
        self.revision = 0
        self.chooser = DecodeChooser(channel_for, config.probe_fanout, config.probe_timeout_ms / 1e3)
        self._records: list[InstanceRecord] = []
        self._rebuild: asyncio.Task | None = None
        self._wakeup: asyncio.TimerHandle | None = None

    def weights(self) -> dict[str, float]:
        return {name: float(self.config.cluster_weights.get(name, 1.0)) for name in sorted(self.fleet.clusters)}

    def apply_membership(self, records: Iterable[InstanceRecord]) -> None:
        """Fold in a membership snapshot (on the event loop); rebuilds the table when the fleet changed."""
        self._records = list(records)
        loop = asyncio.get_running_loop()
        now = self.clock()
        if self.fleet.update(self._records, now):
            self.revision += 1
        HEALTHY_CLUSTERS.set(len(self.fleet.routable(now, self.config.failback_hold_s)))
        MEMBERSHIP_DAMPED.set(len(self.damper.damped))
        # A settling loss or a damping grace ends with no new snapshot: re-derive right then, not at a tick.
        if self._wakeup is not None:
            self._wakeup.cancel()
        deadline = self.damper.next_change(now)
        self._wakeup = None if deadline is None else loop.call_later(max(0.0, deadline - now) + 1e-3, self.tick)
        wanted = self.weights()
        if wanted and (self.table is None or self.table.weights != wanted) and (
                self._rebuild is None or self._rebuild.done()):
            self._rebuild = loop.create_task(self._build_table())

    async def _build_table(self) -> None:
        # Building takes ~0.1-2 s (N = 4..64 at 2**20 slots), so it runs off the loop; the old table keeps
        # serving meanwhile (targets stay right: they only depend on the healthy set). Loop until current.
        while (wanted := self.weights()) and (self.table is None or self.table.weights != wanted):
            started = time.perf_counter()
            self.table = await asyncio.to_thread(PlacementTable, wanted, self.config.slot_bits)
            KNOWN_CLUSTERS.set(len(wanted))
            log.info("placement table built", extra={"clusters": list(wanted), "ms":
                                                     round(1e3 * (time.perf_counter() - started), 1)})

    def tick(self) -> None:
        """Re-derive from the last snapshot, so forgotten clusters and failback holds age without events."""
        self.apply_membership(self._records)

    async def wait_ready(self) -> None:
        if self._rebuild is not None:
            await self._rebuild

    async def Route(self, request: router_pb2.RouteRequest, context) -> router_pb2.RouteResponse:
        session_id = request.session.session_id
        if not session_id:
            raise errors.InvalidArgument("session.session_id", "must not be empty")
        if self.table is None:
            ROUTES.labels("no_fleet").inc()
            raise errors.Unavailable("no cluster has registered yet",
                                     retry_after_ms=int(1000 * self.config.lease_ttl_s))
        routable = self.fleet.routable(self.clock(), self.config.failback_hold_s)
        decision = await self._decide(session_id, routable, request.exclude_clusters)
        if decision.target is None:
            ROUTES.labels("no_healthy_cluster").inc()
            raise errors.Unavailable(f"no healthy cluster (excluded: {list(request.exclude_clusters)})",
                                     retry_after_ms=int(1000 * self.config.lease_ttl_s))
        target = self.fleet.clusters[decision.target]
        choice = await self.chooser.choose(session_id, target.of("decode"), request.block_hashes,
                                           request.hash_block_tokens or self.config.hash_block_tokens)
        ROUTES.labels("failover" if decision.failover else "primary").inc()
        return router_pb2.RouteResponse(
            primary=self._cluster_id(decision.primary), backup=self._cluster_id(decision.backup),
            target=self._cluster_id(decision.target), failover=decision.failover,
            prefill=instance_id(self._pick(session_id, target, "prefill")),
            decode=instance_id(choice.instance if choice else None),
            transfer=instance_id(self._pick(session_id, target, "kvtransfer")),
            expected_hit_tokens=choice.hit_tokens if choice else 0)

    async def _decide(self, session_id: str, routable: set[str], exclude: Sequence[str]) -> RouteDecision:
        table = self.table
        if self.assignments is None:
            return decide(table, session_id, routable, exclude)
        assignment = self.assignments.get(session_id)
        if assignment is not None:
            self.assignments.touch(session_id)
            return decide_assigned(table, session_id, assignment, routable, exclude)
        # etcd unreachable: route anyway and store it on a later turn. The stateless pair has the same primary,
        # so only the backup may differ from the later assignment. A lost watch skips the attempt at once.
        if self.assignments.connected:
            try:
                assignment = await asyncio.to_thread(self.assignments.assign, session_id,
                                                     table.order(session_id), table.weights, routable)
                return decide_assigned(table, session_id, assignment, routable, exclude)
            except Exception as exc:  # noqa: BLE001 - counted and logged; routed statelessly below
                log.warning("session not assigned in etcd; routing it statelessly",
                            extra={"session": session_id, "error": str(exc)})
        ASSIGNMENTS.labels("failed").inc()
        return decide(table, session_id, routable, exclude)

    async def GetFleet(self, request: router_pb2.GetFleetRequest, context) -> router_pb2.GetFleetResponse:
        routable = self.fleet.routable(self.clock(), self.config.failback_hold_s)
        weights = self.weights()
        return router_pb2.GetFleetResponse(revision=self.revision, clusters=[
            router_pb2.ClusterHealth(cluster=self._cluster_id(name), healthy=view.healthy,
                                     instances=[instance_id(r) for r in view.instances], weight=weights[name],
                                     held_down=view.healthy and name not in routable)
            for name, view in sorted(self.fleet.clusters.items())])

    def _cluster_id(self, name: str | None) -> common_pb2.ClusterId | None:
        if name is None:
            return None
        view = self.fleet.clusters.get(name)
        return common_pb2.ClusterId(name=name, region=view.region if view else "")

    @staticmethod
    def _pick(session_id: str, cluster: ClusterView, service: str) -> InstanceRecord | None:
        ranked = rendezvous_rank(session_id, cluster.of(service))
        return ranked[0] if ranked else None
