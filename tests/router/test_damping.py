"""The membership damping rule with a hand-driven clock: a single-cluster loss is never damped; a loss of
more than the fraction at once is, until the grace ends or the clusters return (hypothesis properties
against the rule written out independently here), and the fleet keeps a held cluster's last healthy view."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.router.damping import MassLossDamper
from services.router.membership import FleetTracker
from services.runtime.registry import InstanceRecord

WINDOW_S, GRACE_S = 2.0, 6.0
fleets = st.integers(1, 24).map(lambda n: [f"c{i}" for i in range(n)])
fractions = st.sampled_from([0.25, 0.5, 0.75, 1.0])


def expected_damped(lost: int, before: int, fraction: float) -> bool:
    # The task's rule: at least two, and more than the fraction or all of them.
    return lost >= 2 and (lost * 1.0 > fraction * before or lost == before)


@given(fleet=fleets, fraction=fractions, data=st.data())
def test_a_single_cluster_loss_is_never_damped(fleet, fraction, data):
    damper = MassLossDamper(fraction, GRACE_S, WINDOW_S)
    healthy = set(fleet)
    assert damper.observe(healthy, 0.0) == frozenset()
    # Clusters fail one by one, each more than a window after the previous one.
    order = data.draw(st.permutations(fleet))
    for step, name in enumerate(order, start=1):
        healthy.discard(name)
        assert damper.observe(healthy, step * (WINDOW_S + 0.1)) == frozenset()


@given(fleet=fleets, fraction=fractions, data=st.data())
def test_a_mass_loss_is_held_until_grace_ends_or_it_returns(fleet, fraction, data):
    damper = MassLossDamper(fraction, GRACE_S, WINDOW_S)
    damper.observe(fleet, 0.0)
    lost = set(data.draw(st.lists(st.sampled_from(fleet), unique=True)))
    survivors = set(fleet) - lost
    # The expiries arrive one event at a time, all within the window (a cascade).
    cascade = sorted(lost)
    seen: set[str] = set()
    for i, name in enumerate(cascade):
        seen.add(name)
        held = damper.observe(set(fleet) - seen, 10.0 + i * WINDOW_S / (2 * len(cascade)))
    if not expected_damped(len(lost), len(fleet), fraction):
        if lost:
            assert held == frozenset()
        return
    assert held == lost  # the whole cascade, the first expiries included
    back = set(data.draw(st.lists(st.sampled_from(cascade), unique=True)))
    assert damper.observe(survivors | back, 12.0) == lost - back
    first = min(i for i in range(len(cascade)) if expected_damped(i + 1, len(fleet), fraction))
    damped_at = 10.0 + first * WINDOW_S / (2 * len(cascade))
    # Grace runs from when the damping began; then what has not returned is lost for real, for good.
    assert damper.observe(survivors | back, damped_at + GRACE_S - 0.01) == lost - back
    assert damper.observe(survivors | back, damped_at + GRACE_S) == frozenset()
    assert damper.observe(survivors | back, damped_at + GRACE_S + 0.5) == frozenset()


def test_hand_computed_three_cluster_fleet():
    damper = MassLossDamper(0.5, GRACE_S, WINDOW_S)
    damper.observe({"a", "b", "c"}, 0.0)
    assert damper.observe({"b", "c"}, 1.0) == frozenset()          # 1 of 3: normal failover
    assert damper.observe({"c"}, 2.5) == {"a", "b"}                 # 2 of 3 within 2 s: damped
    assert damper.observe({"a", "c"}, 3.0) == {"b"}                 # a re-registered
    assert damper.observe({"a", "c"}, 8.49) == {"b"}
    assert damper.observe({"a", "c"}, 8.5) == frozenset()           # grace (from 2.5) over: b is gone
    # Two of three apart by more than the window: two single losses, neither damped.
    damper = MassLossDamper(0.5, GRACE_S, WINDOW_S)
    damper.observe({"a", "b", "c"}, 0.0)
    assert damper.observe({"b", "c"}, 1.0) == frozenset()
    assert damper.observe({"c"}, 3.5) == frozenset()
    # 2 of 4 is not more than half; all of 2 is damped; 0 disables.
    damper = MassLossDamper(0.5, GRACE_S, WINDOW_S)
    damper.observe({"a", "b", "c", "d"}, 0.0)
    assert damper.observe({"c", "d"}, 0.5) == frozenset()
    damper = MassLossDamper(0.5, GRACE_S, WINDOW_S)
    damper.observe({"a", "b"}, 0.0)
    assert damper.observe(set(), 0.5) == {"a", "b"}
    for disabled in (MassLossDamper(0.0, GRACE_S, WINDOW_S), MassLossDamper(0.5, 0.0, WINDOW_S)):
        disabled.observe({"a", "b"}, 0.0)
        assert disabled.observe(set(), 0.5) == frozenset()


def decode(cluster: str) -> InstanceRecord:
    return InstanceRecord("decode", cluster, f"{cluster}-d0", f"10.0.0.{ord(cluster[-1])}:1", region="eu")


def test_fleet_routes_held_clusters_on_their_last_healthy_view():
    fleet = FleetTracker({"decode": 1}, forget_after_s=600,
                         damper=MassLossDamper(0.5, GRACE_S, WINDOW_S))
    records = {c: decode(c) for c in ("a", "b", "c")}
    fleet.update(records.values(), 0.0)
    fleet.update([records["b"], records["c"]], 10.0)        # first expiry of a cascade: a fails over
    assert fleet.routable(10.0, 0.0) == {"b", "c"}
    fleet.update([records["c"]], 10.01)                      # second: a mass loss, a comes back with it
    assert fleet.routable(10.01, 0.0) == {"a", "b", "c"} and fleet.held == {"a", "b"}
    assert fleet.clusters["a"].of("decode") == [records["a"]]
    fleet.update([records["a"], records["c"]], 11.0)         # a re-registered: its live view again
    assert fleet.held == {"b"} and fleet.routable(11.0, 0.0) == {"a", "b", "c"}
    fleet.update([records["a"], records["c"]], 10.01 + GRACE_S)  # b never returned: it leaves now
    assert fleet.held == frozenset() and fleet.routable(20.0, 0.0) == {"a", "c"}
    assert not fleet.clusters["b"].healthy and fleet.clusters["b"].instances == ()
