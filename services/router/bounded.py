"""Bounded-load backups: each (primary, backup) pair is capped, so any single failure spreads within the cap.

A stateless placement sends a failed cluster's sessions to their second hash choice, which is counting noise:
at N = 64 and 100K sessions each survivor expects ~25 of them and the largest gets ~1.8x that. Here a
session's backup is chosen once, when it is first routed: the first cluster along the session's own hash
preference order whose pair with the session's primary is under

    cap(p, c) = ceil((1 + eps) * n_p * w_c / W_p)

where n_p counts the sessions whose primary is p (this one included), w_c is c's weight and W_p the total
weight of the clusters other than p. When p fails, survivor c receives at most cap(p, c) of its sessions,
i.e. at most (1 + eps) x its fair share plus one session of rounding. Healthy candidates are preferred; the
caps of all other clusters sum to at least (1 + eps) * n_p > n_p - 1 sessions already placed, so some
cluster always has room (pigeonhole) and the cap is never exceeded at assignment time. The primary is the
plain hash choice, so it stays a pure function of (session, fleet) and adding a cluster moves only what it must.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_EPS = 0.1


@dataclass(frozen=True)
class Assignment:
    primary: str
    # None only when the fleet had a single cluster when the session was assigned.
    backup: str | None


def pair_cap(n_primary: int, weight: float, others_weight: float, eps: float) -> int:
    """The most sessions of a primary with `n_primary` sessions that one backup of `weight` may hold."""
    return math.ceil((1 + eps) * n_primary * weight / others_weight)


class PairLoads:
    """Sessions per primary and per (primary, backup) pair: the counts the caps are checked against."""

    def __init__(self) -> None:
        self.primary: Counter[str] = Counter()
        self.pair: Counter[tuple[str, str | None]] = Counter()

    def add(self, a: Assignment) -> None:
        self.primary[a.primary] += 1
        self.pair[a.primary, a.backup] += 1

    def remove(self, a: Assignment) -> None:
        self.primary[a.primary] -= 1
        self.pair[a.primary, a.backup] -= 1
        # Drop zero entries so the counters stay the size of the live table.
        if not self.primary[a.primary]:
            del self.primary[a.primary]
        if not self.pair[a.primary, a.backup]:
            del self.pair[a.primary, a.backup]


def choose_backup(order: Sequence[str], loads: PairLoads, weights: Mapping[str, float], eps: float,
                  healthy: Collection[str]) -> str | None:
    """The backup for a new session whose hash preference order over the fleet is `order` (primary first).

    The first healthy cluster in order whose pair is under its cap; failing that (only possible while some
    clusters are down), the first cluster in order under its cap."""
    primary, others = order[0], order[1:]
    if not others:
        return None
    n_primary = loads.primary[primary] + 1
    others_weight = sum(weights[c] for c in others)

    def has_room(c: str) -> bool:
        return loads.pair[primary, c] + 1 <= pair_cap(n_primary, weights[c], others_weight, eps)

    for c in others:
        if c in healthy and has_room(c):
            return c
    # Pigeonhole (module docstring): some cluster has room, so this never runs off the end.
    return next(c for c in others if has_room(c))


def assign(order: Sequence[str], loads: PairLoads, weights: Mapping[str, float], eps: float,
           healthy: Collection[str]) -> Assignment:
    """Assign a new session in memory and count it (the etcd store does the same under a transaction)."""
    assignment = Assignment(order[0], choose_backup(order, loads, weights, eps, healthy))
    loads.add(assignment)
    return assignment
