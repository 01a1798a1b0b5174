"""Which cluster a session's request goes to now, given the fleet and which of its clusters are healthy.

Primary and backup come from the placement table over the whole known fleet (healthy or not), so they
stay fixed while a cluster is down; the target is the first healthy, non-excluded cluster in the session's
rendezvous order: the primary, else the pre-assigned backup, else (double failure) the next choice.
Because rendezvous scores are per (session, cluster), that target equals the top choice over the healthy
set alone, so router replicas that know different supersets of the fleet still pick the same target.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.router.placement import PlacementTable, first_healthy


@dataclass(frozen=True)
class RouteDecision:
    primary: str
    backup: str | None
    # None when no cluster of the fleet is healthy.
    target: str | None

    @property
    def failover(self) -> bool:
        return self.target is not None and self.target != self.primary


def decide(table: PlacementTable, session_id: str, healthy: Collection[str],
           exclude: Collection[str] = ()) -> RouteDecision:
    placement = table.place(session_id)
    usable = set(healthy).difference(exclude)
    if placement.primary in usable:
        target: str | None = placement.primary
    elif placement.backup in usable:
        target = placement.backup
    else:
        target = first_healthy(table.order(session_id), usable)
    return RouteDecision(placement.primary, placement.backup, target)
