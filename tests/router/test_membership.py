"""Fleet health from instance records: quorum per service, the forget window, the failback hold-down."""

from __future__ import annotations

import pytest

from services.router.membership import FleetTracker, derive_clusters, parse_requirements
from services.runtime.registry import InstanceRecord


def rec(service: str, cluster: str, instance: str) -> InstanceRecord:
    return InstanceRecord(service, cluster, instance, f"{instance}.local:50051")


def test_health_needs_every_required_service_at_quorum():
    records = [rec("decode", "a", "a-d0"), rec("decode", "a", "a-d1"), rec("prefill", "a", "a-p0"),
               rec("decode", "b", "b-d0"), rec("prefill", "c", "c-p0"),
               rec("router", "global", "r0"), rec("gateway", "global", "g0")]
    views = derive_clusters(records, {"decode": 2})
    assert set(views) == {"a", "b", "c"}  # the control plane's "global" is not a serving cluster
    assert {n for n, v in views.items() if v.healthy} == {"a"}
    views = derive_clusters(records, {"decode": 1, "prefill": 1})
    assert {n for n, v in views.items() if v.healthy} == {"a"}
    assert [r.instance for r in views["a"].of("decode")] == ["a-d0", "a-d1"]


def test_vanished_cluster_stays_unhealthy_until_forgotten():
    tracker = FleetTracker({"decode": 1}, forget_after_s=30)
    both = [rec("decode", "a", "a0"), rec("decode", "b", "b0")]
    assert tracker.update(both, now=0)
    assert tracker.update(both[:1], now=1)
    assert set(tracker.clusters) == {"a", "b"} and not tracker.clusters["b"].healthy
    assert tracker.routable(1, 0) == {"a"}
    assert not tracker.update(both[:1], now=29)  # b last seen at 0: not forgotten yet
    assert tracker.update(both[:1], now=30.5)
    assert set(tracker.clusters) == {"a"}


def test_recovered_cluster_is_held_down_for_the_failback_hold():
    tracker = FleetTracker({"decode": 1}, forget_after_s=600)
    both = [rec("decode", "a", "a0"), rec("decode", "b", "b0")]
    tracker.update(both, now=0)
    # Clusters healthy from the start are not held down.
    assert tracker.routable(0, failback_hold_s=5) == {"a", "b"}
    tracker.update(both[:1], now=1)
    tracker.update(both, now=10)
    assert tracker.routable(12, failback_hold_s=5) == {"a"}
    assert tracker.routable(15, failback_hold_s=5) == {"a", "b"}
    assert tracker.routable(12, failback_hold_s=0) == {"a", "b"}


@pytest.mark.parametrize("text, needle", [("", "at least one"), ("router:1", "'router'"),
                                          ("decode:0", "integer >= 1"), ("decode:x", "integer >= 1")])
def test_bad_requirements_name_the_field(text, needle):
    with pytest.raises(ValueError, match="required_instances") as err:
        parse_requirements(text)
    assert needle in str(err.value)


def test_requirements_parse():
    assert parse_requirements("decode:2, prefill") == {"decode": 2, "prefill": 1}
