"""Which cluster a session's request goes to now, given its (primary, backup) and which clusters are healthy.

Stateless mode: primary and backup come from the placement table over the whole known fleet (healthy or
not), so they stay fixed while a cluster is down. Bounded mode: they are the session's stored assignment.
Either way the target is the primary if usable, else the pre-assigned backup, else (double failure) the
first usable cluster in the session's rendezvous order. In stateless mode, because rendezvous scores are
per (session, cluster), that target equals the top choice over the healthy set alone, so router replicas
that know different supersets of the fleet still pick the same target.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.router.bounded import Assignment
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
    """Stateless mode: a pure function of (session, fleet, healthy set)."""
    placement = table.place(session_id)
    return decide_assigned(table, session_id, Assignment(placement.primary, placement.backup), healthy, exclude)


def decide_assigned(table: PlacementTable, session_id: str, assignment: Assignment, healthy: Collection[str],
                    exclude: Collection[str] = ()) -> RouteDecision:
    """The target for a session whose (primary, backup) is already known."""
    usable = set(healthy).difference(exclude) if exclude else healthy
    if assignment.primary in usable:
        target: str | None = assignment.primary
    elif assignment.backup in usable:
        target = assignment.backup
    else:
        target = first_healthy(table.order(session_id), set(usable))
    return RouteDecision(assignment.primary, assignment.backup, target)
