"""Properties of bounded-mode assignment (services/router/bounded.py) and of routing an assigned session."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.bounded import Assignment, PairLoads, assign, pair_cap
from services.router.decision import decide_assigned
from services.router.placement import PlacementTable

SLOT_BITS = 10
settings.register_profile("bounded", max_examples=50, deadline=None)
settings.load_profile("bounded")

cluster_names = st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=6)
fleets = st.sets(cluster_names, min_size=2, max_size=9)
weight_values = st.sampled_from([1.0, 1.0, 2.0, 0.5, 3.0])
session_ids = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=300, unique=True)
eps_values = st.sampled_from([0.0, 0.1, 0.5])


def cap_of(loads: PairLoads, primary: str, backup: str, weights: dict[str, float], eps: float) -> int:
    # The bound from the brief, computed here from scratch: ceil((1 + eps) * n_p * w_b / sum of others).
    others = sum(w for c, w in weights.items() if c != primary)
    return math.ceil((1 + eps) * loads.primary[primary] * weights[backup] / others)


@given(fleets, session_ids, eps_values, st.data())
def test_cap_is_never_exceeded_and_backup_is_never_the_primary(fleet, ids, eps, data):
    weights = {c: data.draw(weight_values) for c in sorted(fleet)}
    table = PlacementTable(weights, slot_bits=SLOT_BITS)
    loads = PairLoads()
    for s in ids:
        # Health changes as sessions arrive; at least the primary's peers are not all guaranteed healthy.
        healthy = data.draw(st.sets(st.sampled_from(sorted(fleet))))
        a = assign(table.order(s), loads, table.weights, eps, healthy)
        assert a.primary == table.place(s).primary  # the primary is the plain consistent-hash choice
        assert a.backup is not None and a.backup != a.primary and a.backup in fleet
        # Insert-only history: every pair is within the cap of its primary's current size, at every step.
        for (p, b), count in loads.pair.items():
            assert count <= cap_of(loads, p, b, weights, eps)
        # Healthy clusters are preferred: an unhealthy backup means every healthy candidate was full.
        if a.backup not in healthy:
            loads.remove(a)
            n_p = loads.primary[a.primary] + 1
            others = sum(w for c, w in weights.items() if c != a.primary)
            for c in healthy - {a.primary}:
                assert loads.pair[a.primary, c] + 1 > pair_cap(n_p, weights[c], others, eps)
            loads.add(a)


@given(fleets, session_ids, st.data())
def test_cap_holds_at_each_assignment_while_sessions_expire(fleet, ids, data):
    table = PlacementTable(dict.fromkeys(fleet, 1.0), slot_bits=SLOT_BITS)
    loads, live = PairLoads(), []
    for s in ids:
        if live and data.draw(st.booleans()):
            loads.remove(live.pop(data.draw(st.integers(0, len(live) - 1))))
        a = assign(table.order(s), loads, table.weights, 0.1, set(fleet))
        live.append(a)
        # Expiry can leave older pairs above a shrunken primary's cap; a new assignment never lands above it.
        assert loads.pair[a.primary, a.backup] <= cap_of(loads, a.primary, a.backup, table.weights, 0.1)
    assert sum(loads.primary.values()) == len(live) == sum(loads.pair.values())


@given(st.integers(3, 24), st.integers(1, 2000))
def test_a_single_failure_spreads_within_the_cap(n, sessions):
    fleet = [f"c{i}" for i in range(n)]
    table = PlacementTable(dict.fromkeys(fleet, 1.0), slot_bits=SLOT_BITS)
    loads = PairLoads()
    pairs = [assign(table.order(f"s{i}"), loads, table.weights, 0.1, set(fleet)) for i in range(sessions)]
    for failed in fleet:
        moved = [a.backup for a in pairs if a.primary == failed]
        if moved:
            largest = max(moved.count(c) for c in set(moved))
            # (1 + eps) x the ideal share 1/(N-1), plus at most one session of rounding.
            assert largest <= 1.1 * len(moved) / (n - 1) + 1


@given(fleets.filter(lambda f: len(f) >= 3), session_ids, st.data())
def test_routing_an_assigned_session(fleet, ids, data):
    table = PlacementTable(dict.fromkeys(fleet, 1.0), slot_bits=SLOT_BITS)
    loads = PairLoads()
    for s in ids[:40]:
        a = assign(table.order(s), loads, table.weights, 0.1, fleet)
        # Both healthy: the stored pair, to the primary, whatever else is down.
        others_down = data.draw(st.sets(st.sampled_from(sorted(fleet - {a.primary, a.backup}))))
        d = decide_assigned(table, s, a, fleet - others_down)
        assert (d.primary, d.backup, d.target, d.failover) == (a.primary, a.backup, a.primary, False)
        # Primary lost: its backup.
        d = decide_assigned(table, s, a, fleet - {a.primary})
        assert (d.primary, d.backup, d.target, d.failover) == (a.primary, a.backup, a.backup, True)
        # Both lost: the first healthy cluster in the session's own order.
        d = decide_assigned(table, s, a, fleet - {a.primary, a.backup})
        assert d.target == next(c for c in table.order(s) if c not in {a.primary, a.backup})
        # The caller's exclusions act like failures.
        assert decide_assigned(table, s, a, fleet, exclude=[a.primary]).target == a.backup


def test_single_cluster_fleet_has_no_backup():
    loads = PairLoads()
    assert assign(["only"], loads, {"only": 1.0}, 0.1, {"only"}) == Assignment("only", None)
    assert loads.pair["only", None] == 1


def test_pair_cap_hand_computed():
    # 1562 sessions over 63 survivors at eps 0.1: 27.27 -> 28, i.e. 1.129 x the ideal 24.79.
    assert pair_cap(1562, 1.0, 63.0, 0.1) == 28
    assert pair_cap(1, 1.0, 63.0, 0.1) == 1
    assert pair_cap(10, 2.0, 4.0, 0.0) == 5
