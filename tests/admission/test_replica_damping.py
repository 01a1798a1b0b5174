"""Budget ownership under admission replica membership damping, with a hand-driven clock.

A mass expiry of admission records (etcd stalled past the lease TTL) leaves ownership of every cluster where
it was until the replicas re-register or the grace ends; a single replica's loss moves exactly its clusters,
each to its second choice in rendezvous order (the oracle: the ranking over the full set, not the code under
test), once the loss has settled, as it did before damping."""

from __future__ import annotations

import logging

from services.admission.config import AdmissionConfig
from services.admission.replica_view import MEMBERSHIP_DAMPED, ReplicaView
from services.admission.service import owner_of
from services.router.placement import rendezvous_rank
from services.runtime.registry import InstanceRecord

TTL_S, GRACE_S, SETTLE_S = 2.0, 6.0, 0.25  # binary-exact, so now - lost_at == SETTLE_S
REPLICAS = [InstanceRecord("admission", "global", f"adm-{i}", f"10.0.0.{i}:50062") for i in range(4)]
CLUSTERS = [f"c{i}" for i in range(64)]


class Registry:
    """Stands in for the etcd Watcher's snapshot (the real one is exercised by the service tests)."""

    def __init__(self):
        self.records = list(REPLICAS) + [InstanceRecord("decode", "c0", "d0", "10.0.1.0:1")]
        self.now = 0.0

    def view(self, fraction: float = 0.5) -> ReplicaView:
        settings = AdmissionConfig(mass_loss_fraction=fraction, mass_loss_grace_s=GRACE_S, lease_ttl_s=TTL_S,
                                   mass_loss_settle_s=SETTLE_S)
        return ReplicaView(lambda: list(self.records), settings, lambda: self.now)

    def drop(self, *names: str) -> None:
        self.records = [r for r in self.records if r.instance not in names]


def owners(view: ReplicaView) -> dict[str, str]:
    replicas = view()
    return {c: owner_of(c, replicas).instance for c in CLUSTERS}


def test_mass_expiry_keeps_ownership_until_the_replicas_return(caplog):
    registry = Registry()
    view = registry.view()
    before = owners(view)
    assert set(before.values()) == {r.instance for r in REPLICAS}  # 64 clusters spread over all 4
    with caplog.at_level(logging.WARNING, "k3.admission"):
        # etcd expires the leases as a cascade a few ms apart, with calls landing in between.
        for i, replica in enumerate(REPLICAS):
            registry.now = 10.0 + 0.003 * i
            registry.drop(replica.instance)
            assert owners(view) == before
        assert MEMBERSHIP_DAMPED._value.get() == len(REPLICAS)
        # Stays put through the grace while nothing has re-registered.
        for registry.now in (10.5, 12.0, 10.0 + GRACE_S - 0.1):
            assert owners(view) == before
    damped = [r for r in caplog.records if getattr(r, "event", None) == "membership_damped"]
    assert damped and damped[-1].lost == sorted(r.instance for r in REPLICAS)
    assert "admission replicas" in damped[-1].getMessage()
    # They re-register (two now, two a moment later): ownership never moved.
    registry.records += REPLICAS[:2]
    assert owners(view) == before
    registry.now += 0.5
    registry.records += REPLICAS[2:]
    assert owners(view) == before and MEMBERSHIP_DAMPED._value.get() == 0


def test_grace_end_drops_replicas_that_never_returned():
    registry = Registry()
    view = registry.view()
    assert len(view()) == len(REPLICAS)
    registry.drop("adm-0", "adm-1", "adm-2")
    registry.now = 1.0
    assert {r.instance for r in view()} == {r.instance for r in REPLICAS}
    registry.now = 1.0 + GRACE_S
    assert [r.instance for r in view()] == ["adm-3"]
    assert set(owners(view).values()) == {"adm-3"}


def test_single_replica_loss_moves_exactly_its_clusters_after_settling():
    registry = Registry()
    view = registry.view()
    before = owners(view)
    registry.now = 5.0
    registry.drop("adm-1")
    assert owners(view) == before  # still settling: a delete-then-re-register is not acted on
    registry.now = 5.0 + SETTLE_S
    after = owners(view)
    for cluster in CLUSTERS:
        ranked = [r.instance for r in rendezvous_rank(cluster, REPLICAS)]
        expected = ranked[1] if ranked[0] == "adm-1" else ranked[0]
        assert after[cluster] == expected == (before[cluster] if before[cluster] != "adm-1" else ranked[1])
    assert "adm-1" in before.values() and "adm-1" not in after.values()
    assert MEMBERSHIP_DAMPED._value.get() == 0


def test_disabled_damping_acts_on_a_mass_loss_at_once():
    registry = Registry()
    view = registry.view(fraction=0.0)
    assert len(view()) == len(REPLICAS)
    registry.drop("adm-0", "adm-1", "adm-2")
    assert [r.instance for r in view()] == ["adm-3"]


def test_config_flags_and_validation():
    config = AdmissionConfig.load("admission", ["--mass-loss-fraction", "0.75", "--mass-loss-settle-s", "0.2",
                                                "--lease-ttl-s", "3"], env={})
    assert (config.mass_loss_fraction, config.mass_loss_settle_s, config.mass_loss_grace()) == (0.75, 0.2, 6.0)
    bad = AdmissionConfig(mass_loss_fraction=1.5, mass_loss_settle_s=9.0, mass_loss_grace_s=-1.0)
    assert {p.split(":")[0] for p in bad.validate()} >= {"mass_loss_fraction", "mass_loss_settle_s",
                                                         "mass_loss_grace_s"}
