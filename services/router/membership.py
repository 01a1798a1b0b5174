"""The fleet as the router sees it, derived from etcd instance records (a pure function of them).

A cluster is any cluster name with data-plane instances (prefill, decode, kvtransfer); it is healthy while
every required service has at least its minimum number of live instances (live = its lease-bound record is
in etcd). A cluster whose records all expired stays in the fleet, unhealthy, for `forget_after_s`: its
sessions keep their (primary, backup) and the router reports them as failed over instead of re-placing them.
A mass loss (etcd-side lease expiry) is damped: the lost clusters keep their last healthy view (damping.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.router.damping import MassLossDamper
from services.runtime.registry import InstanceRecord

DATA_PLANE = frozenset({"prefill", "decode", "kvtransfer"})


@dataclass(frozen=True)
class ClusterView:
    name: str
    region: str
    healthy: bool
    # Live data-plane instances, sorted by (service, instance).
    instances: tuple[InstanceRecord, ...]

    def of(self, service: str) -> list[InstanceRecord]:
        return [r for r in self.instances if r.service == service]


def parse_requirements(text: str) -> dict[str, int]:
    """"decode:1,prefill:1" -> {"decode": 1, "prefill": 1}; a bare name means at least one."""
    required: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        service, _, count = item.partition(":")
        if service not in DATA_PLANE:
            raise ValueError(f"required_instances: {service!r} is not one of {sorted(DATA_PLANE)}")
        if count and (not count.isdigit() or int(count) < 1):
            raise ValueError(f"required_instances: count for {service!r} must be an integer >= 1")
        required[service] = int(count) if count else 1
    if not required:
        raise ValueError("required_instances: name at least one service, e.g. 'decode:1'")
    return required


def derive_clusters(records: Iterable[InstanceRecord], required: Mapping[str, int]) -> dict[str, ClusterView]:
    grouped: dict[str, list[InstanceRecord]] = {}
    for record in records:
        if record.service in DATA_PLANE:
            grouped.setdefault(record.cluster, []).append(record)
    views = {}
    for name, members in grouped.items():
        members.sort(key=lambda r: (r.service, r.instance))
        healthy = all(sum(r.service == s for r in members) >= n for s, n in required.items())
        views[name] = ClusterView(name, members[0].region, healthy, tuple(members))
    return views


class FleetTracker:
    """Adds memory to derive_clusters: when clusters were last seen, and when they last became healthy."""

    def __init__(self, required: Mapping[str, int], forget_after_s: float, damper: MassLossDamper | None = None):
        self.required = dict(required)
        self.forget_after_s = forget_after_s
        self.damper = damper
        # Clusters routed on their last healthy view although not healthy now (damped or settling losses).
        self.held: frozenset[str] = frozenset()
        self.last_healthy: dict[str, ClusterView] = {}
        self.clusters: dict[str, ClusterView] = {}
        self.last_seen: dict[str, float] = {}
        self.recovered_at: dict[str, float] = {}

    def update(self, records: Iterable[InstanceRecord], now: float) -> bool:
        """Fold in a new membership snapshot; True when any cluster's view changed."""
        live = derive_clusters(records, self.required)
        if self.damper is not None:
            self.held = self.damper.observe((n for n, v in live.items() if v.healthy), now)
            # A held cluster is routed on its last healthy view, also when it left just before the loss
            # was recognised as a mass loss (the first of a cascade of expiries).
            self.last_healthy.update((n, v) for n, v in live.items() if v.healthy)
            live.update((name, self.last_healthy[name]) for name in self.held if name in self.last_healthy)
        merged: dict[str, ClusterView] = {}
        for name, view in live.items():
            previous = self.clusters.get(name)
            if view.healthy and previous is not None and not previous.healthy and name not in self.held:
                self.recovered_at[name] = now
            self.last_seen[name] = now
            merged[name] = view
        for name, view in self.clusters.items():
            if name not in live and now - self.last_seen[name] < self.forget_after_s:
                merged[name] = ClusterView(name, view.region, False, ())
        for name in set(self.last_seen) - set(merged):
            del self.last_seen[name]
            self.recovered_at.pop(name, None)
            self.last_healthy.pop(name, None)
        changed = merged != self.clusters
        self.clusters = merged
        return changed

    def routable(self, now: float, failback_hold_s: float) -> set[str]:
        """Healthy clusters, except those that recovered less than `failback_hold_s` ago."""
        return {name for name, view in self.clusters.items()
                if view.healthy and now - self.recovered_at.get(name, float("-inf")) >= failback_hold_s}
