"""Session placement: weighted rendezvous (HRW) hashing of sessions onto clusters, primary + backup.

A session hashes to one of 2**slot_bits slots; each slot ranks every cluster by a weighted rendezvous
score and the top two are the slot's (primary, backup). Rendezvous gives the properties the fleet needs:
- removing a cluster moves only the sessions it held, and each moves to its own second choice, i.e. its
  pre-assigned backup, so a failed cluster's sessions spread over all survivors in proportion to weight;
- adding a cluster moves only the sessions it now wins (its weight share);
- the result is a pure function of (session, cluster weights): router replicas agree without talking.
Slots exist for speed: a decision is one hash and two array reads, and the per-slot table is built with
numpy. 2**20 slots keep the slot granularity far below the session-count noise (see docs/control-plane.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # placement is pure hashing; it needs the record type for annotations only
    from services.runtime.registry import InstanceRecord

MASK64 = (1 << 64) - 1
DEFAULT_SLOT_BITS = 20
# Scores are computed for this many slots at a time to bound the table build's temporary memory.
BUILD_CHUNK = 1 << 18


@dataclass(frozen=True)
class Placement:
    primary: str
    # None only when the fleet has a single cluster.
    backup: str | None


def session_hash(session_id: str) -> int:
    """A 64-bit hash stable across processes and machines (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=1 << 16)
def _instance_hash(instance: str) -> int:
    # Instance names are few and long-lived; ranking them is on every routing decision.
    return session_hash(instance)


def rendezvous_rank(key: str, instances: Sequence[InstanceRecord]) -> list[InstanceRecord]:
    """Instances ranked for `key` (a session, or a cluster for admission ownership) by unweighted HRW,
    best first; ties broken by instance name."""
    seed = session_hash(key)
    return sorted(instances, key=lambda r: (-mix64(seed ^ _instance_hash(r.instance)), r.instance))


def cluster_seed(cluster: str) -> int:
    return int.from_bytes(hashlib.blake2b(cluster.encode(), digest_size=8, person=b"k3-cluster").digest(),
                          "little")


def mix64(x: int) -> int:
    """The splitmix64 finaliser: a bijective avalanche mix, the same arithmetic as mix64_array."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(mixed: int) -> float:
    # 53 random bits mapped into the open interval (0, 1).
    return ((mixed >> 11) + 0.5) / float(1 << 53)


def rendezvous_score(slot: int, seed: int, weight: float) -> float:
    """Weighted HRW score (logarithmic method): a cluster wins a slot with probability weight / sum."""
    return -weight / math.log(_uniform(mix64(slot ^ seed)))


def rendezvous_order(slot: int, weights: Mapping[str, float]) -> list[str]:
    """Every cluster ranked for one slot, best first; ties broken by name. The reference definition."""
    scored = [(-rendezvous_score(slot, cluster_seed(c), w), c) for c, w in weights.items()]
    return [c for _, c in sorted(scored)]


def validate_weights(weights: Mapping[str, float]) -> dict[str, float]:
    if not weights:
        raise ValueError("weights: the fleet has no clusters")
    for name, w in weights.items():
        if not name:
            raise ValueError("weights: empty cluster name")
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"weights: cluster {name!r} has weight {w}; weights must be finite and > 0")
    return dict(sorted(weights.items()))


class PlacementTable:
    """The (primary, backup) of every slot for one fleet; immutable, rebuilt when the fleet changes."""

    def __init__(self, weights: Mapping[str, float], slot_bits: int = DEFAULT_SLOT_BITS):
        if not 1 <= slot_bits <= 30:
            raise ValueError(f"slot_bits: {slot_bits} is outside 1..30")
        self.weights = validate_weights(weights)
        self.clusters: list[str] = list(self.weights)
        self.slot_bits = slot_bits
        self._shift = 64 - slot_bits
        self._primary, self._backup = self._build()
        # Python lists index faster than numpy arrays for single lookups.
        self._primary_list: list[int] = self._primary.tolist()
        self._backup_list: list[int] = self._backup.tolist()

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        n_slots = 1 << self.slot_bits
        primary = np.empty(n_slots, dtype=np.int16)
        backup = np.full(n_slots, -1, dtype=np.int16)
        seeds = [np.uint64(cluster_seed(c)) for c in self.clusters]
        for start in range(0, n_slots, BUILD_CHUNK):
            slots = np.arange(start, min(start + BUILD_CHUNK, n_slots), dtype=np.uint64)
            best = np.full(len(slots), -np.inf)
            second = np.full(len(slots), -np.inf)
            best_i = np.full(len(slots), -1, dtype=np.int16)
            second_i = np.full(len(slots), -1, dtype=np.int16)
            # Clusters in name order with strict comparisons: ties go to the earlier name, as in the reference.
            for i, (seed, w) in enumerate(zip(seeds, self.weights.values(), strict=True)):
                u = ((mix64_array(slots ^ seed) >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
                score = -w / np.log(u)
                beats_best = score > best
                beats_second = ~beats_best & (score > second)
                second = np.where(beats_best, best, np.where(beats_second, score, second))
                second_i = np.where(beats_best, best_i, np.where(beats_second, i, second_i))
                best = np.where(beats_best, score, best)
                best_i = np.where(beats_best, i, best_i)
            primary[start:start + len(slots)] = best_i
            backup[start:start + len(slots)] = second_i
        return primary, backup

    def slot_of(self, session_id: str) -> int:
        return session_hash(session_id) >> self._shift

    def place(self, session_id: str) -> Placement:
        slot = session_hash(session_id) >> self._shift
        b = self._backup_list[slot]
        return Placement(self.clusters[self._primary_list[slot]], self.clusters[b] if b >= 0 else None)

    def order(self, session_id: str) -> list[str]:
        """The session's full preference order over the fleet (slow path: double failures)."""
        return rendezvous_order(self.slot_of(session_id), self.weights)

    def slot_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-slot primary and backup cluster indices (into self.clusters); read-only views for analysis."""
        return self._primary, self._backup


def first_healthy(order: Iterable[str], healthy: set[str]) -> str | None:
    return next((c for c in order if c in healthy), None)
