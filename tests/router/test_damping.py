"""The membership damping rule with a hand-driven clock: a single-cluster loss is never damped (it takes
effect once it has settled); a loss of more than the fraction at once is, until the grace ends or the
clusters return (hypothesis properties against the rule written out independently here), and the fleet
keeps a held cluster's last healthy view."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.router.damping import MassLossDamper
from services.router.membership import FleetTracker
from services.runtime.registry import InstanceRecord

WINDOW_S, GRACE_S, SETTLE_S = 2.0, 6.0, 0.25
fleets = st.integers(1, 24).map(lambda n: [f"c{i}" for i in range(n)])
fractions = st.sampled_from([0.25, 0.5, 0.75, 1.0])


def expected_damped(lost: int, before: int, fraction: float) -> bool:
    # The task's rule: at least two, and more than the fraction or all of them.
    return lost >= 2 and (lost * 1.0 > fraction * before or lost == before)


def damper(fraction: float = 0.5, grace_s: float = GRACE_S) -> MassLossDamper:
    return MassLossDamper(fraction, grace_s, WINDOW_S, SETTLE_S)


@given(fleet=fleets, fraction=fractions, data=st.data())
def test_a_single_cluster_loss_is_never_damped(fleet, fraction, data):
    rule = damper(fraction)
    healthy = set(fleet)
    assert rule.observe(healthy, 0.0) == frozenset()
    # Clusters fail one by one, each more than a window after the previous one.
    for step, name in enumerate(data.draw(st.permutations(fleet)), start=1):
        healthy.discard(name)
        lost_at = step * (WINDOW_S + 0.1)
        assert rule.observe(healthy, lost_at) == {name} and rule.damped == frozenset()  # settling
        assert rule.next_change(lost_at) == lost_at + SETTLE_S
        assert rule.observe(healthy, lost_at + SETTLE_S) == frozenset() and rule.damped == frozenset()
        assert rule.next_change(lost_at + SETTLE_S) is None


@given(fleet=fleets, fraction=fractions, data=st.data())
def test_a_mass_loss_is_held_until_grace_ends_or_it_returns(fleet, fraction, data):
    rule = damper(fraction)
    rule.observe(fleet, 0.0)
    cascade = sorted(data.draw(st.lists(st.sampled_from(fleet), unique=True)))
    lost, survivors = set(cascade), set(fleet) - set(cascade)
    # The expiries arrive one event at a time, all within the settle time (a cascade).
    step = SETTLE_S / (2 * max(1, len(cascade)))
    for i in range(len(cascade)):
        kept = rule.observe(survivors | set(cascade[i + 1:]), 10.0 + i * step)
    if not expected_damped(len(lost), len(fleet), fraction):
        # Not damped: each loss takes effect once settled.
        assert rule.damped == frozenset() and rule.observe(survivors, 10.0 + 2 * SETTLE_S) == frozenset()
        return
    assert kept == lost == rule.damped  # the whole cascade, the first expiries included
    back = set(data.draw(st.lists(st.sampled_from(cascade), unique=True)))
    assert rule.observe(survivors | back, 12.0) == lost - back
    damped_at = 10.0 + min(i for i in range(len(cascade)) if expected_damped(i + 1, len(fleet), fraction)) * step
    # Grace runs from when the damping began; then what has not returned is lost for real, for good.
    assert rule.next_change(12.0) == (damped_at + GRACE_S if lost - back else None)
    assert rule.observe(survivors | back, damped_at + GRACE_S - 0.01) == lost - back
    assert rule.observe(survivors | back, damped_at + GRACE_S) == frozenset()
    assert rule.observe(survivors | back, damped_at + GRACE_S + 0.5) == frozenset()


def test_hand_computed_three_cluster_fleet():
    rule = damper()
    rule.observe({"a", "b", "c"}, 0.0)
    assert rule.observe({"b", "c"}, 1.0) == {"a"}                  # 1 of 3: settling ...
    assert rule.observe({"b", "c"}, 1.25) == frozenset()            # ... then the normal failover
    assert rule.observe({"c"}, 2.5) == {"a", "b"} == rule.damped    # 2 of 3 within 2 s: damped
    assert rule.observe({"a", "c"}, 3.0) == {"b"}                   # a re-registered
    assert rule.observe({"a", "c"}, 8.49) == {"b"}
    assert rule.observe({"a", "c"}, 8.5) == frozenset()             # grace (from 2.5) over: b is gone
    # A delete and re-register within the settle time is never acted on.
    rule = damper()
    rule.observe({"a", "b", "c"}, 0.0)
    assert rule.observe({"b", "c"}, 1.0) == {"a"}
    assert rule.observe({"a", "b", "c"}, 1.1) == frozenset() and rule.next_change(1.1) is None
    # Two of three apart by more than the window: two single losses, neither damped.
    rule = damper()
    rule.observe({"a", "b", "c"}, 0.0)
    rule.observe({"b", "c"}, 1.0)
    assert rule.observe({"c"}, 3.5) == {"b"} and rule.damped == frozenset()
    # 2 of 4 is not more than half; all of 2 is damped; 0 disables damping and settling.
    rule = damper()
    rule.observe({"a", "b", "c", "d"}, 0.0)
    assert rule.observe({"c", "d"}, 0.5) == {"a", "b"} and rule.damped == frozenset()
    rule = damper()
    rule.observe({"a", "b"}, 0.0)
    assert rule.observe(set(), 0.5) == {"a", "b"} == rule.damped
    for disabled in (damper(fraction=0.0), damper(grace_s=0.0)):
        disabled.observe({"a", "b"}, 0.0)
        assert disabled.observe(set(), 0.5) == frozenset() and disabled.next_change(0.5) is None


def decode(cluster: str) -> InstanceRecord:
    return InstanceRecord("decode", cluster, f"{cluster}-d0", f"10.0.0.{ord(cluster[-1])}:1", region="eu")


def test_fleet_routes_held_clusters_on_their_last_healthy_view():
    fleet = FleetTracker({"decode": 1}, forget_after_s=600, damper=damper())
    records = {c: decode(c) for c in ("a", "b", "c")}
    fleet.update(records.values(), 0.0)
    fleet.update([records["b"], records["c"]], 10.0)        # first expiry of a cascade: settling
    assert fleet.routable(10.0, 0.0) == {"a", "b", "c"}
    fleet.update([records["c"]], 10.01)                      # second: a mass loss
    assert fleet.routable(10.01, 0.0) == {"a", "b", "c"} and fleet.held == {"a", "b"}
    assert fleet.clusters["a"].of("decode") == [records["a"]]
    fleet.update([records["a"], records["c"]], 11.0)         # a re-registered: its live view again
    assert fleet.held == {"b"} and fleet.routable(11.0, 30.0) == {"a", "b", "c"}  # no failback hold either
    fleet.update([records["a"], records["c"]], 10.01 + GRACE_S)  # b never returned: it leaves now
    assert fleet.held == frozenset() and fleet.routable(20.0, 0.0) == {"a", "c"}
    assert not fleet.clusters["b"].healthy and fleet.clusters["b"].instances == ()
