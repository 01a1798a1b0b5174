"""Properties of session placement, checked against the reference rendezvous definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.decision import decide
from services.router.placement import PlacementTable, rendezvous_order

SLOT_BITS = 10  # small tables keep every example fast; the properties do not depend on the size

cluster_names = st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=8)
fleets = st.sets(cluster_names, min_size=2, max_size=10)
sessions = st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=30)
settings.register_profile("placement", max_examples=60, deadline=None)
settings.load_profile("placement")


def table(clusters, weights=None) -> PlacementTable:
    return PlacementTable({c: (weights or {}).get(c, 1.0) for c in clusters}, slot_bits=SLOT_BITS)


@given(fleets, sessions)
def test_placement_is_a_pure_function_of_session_and_fleet(fleet, ids):
    forward = table(sorted(fleet))
    backward = table(sorted(fleet, reverse=True))
    for s in ids:
        order = rendezvous_order(forward.slot_of(s), forward.weights)
        assert forward.place(s) == backward.place(s)
        assert (forward.place(s).primary, forward.place(s).backup) == (order[0], order[1])


@given(fleets, sessions)
def test_backup_differs_from_primary(fleet, ids):
    t = table(fleet)
    for s in ids:
        p = t.place(s)
        assert p.backup is not None and p.backup != p.primary


def test_single_cluster_has_no_backup():
    assert table({"only"}).place("s").backup is None


@given(fleets, cluster_names)
def test_adding_a_cluster_moves_only_what_it_wins(fleet, new):
    if new in fleet:
        return
    old, grown = table(fleet), table(fleet | {new})
    p_old, b_old = old.slot_pairs()
    p_new, b_new = grown.slot_pairs()
    names_old, names_new = np.array(old.clusters), np.array(grown.clusters)
    moved = names_old[p_old] != names_new[p_new]
    # A session's primary only ever moves to the new cluster, and where it does the old primary becomes backup.
    assert (names_new[p_new][moved] == new).all()
    assert (names_new[b_new][moved] == names_old[p_old][moved]).all()
    # A backup changes only to the new cluster (or because the old primary was demoted to backup).
    changed = ~moved & (names_old[b_old] != names_new[b_new])
    assert (names_new[b_new][changed] == new).all()


@given(fleets.filter(lambda f: len(f) >= 3), st.data())
def test_removing_a_cluster_sends_its_sessions_to_their_backups(fleet, data):
    gone = data.draw(st.sampled_from(sorted(fleet)))
    old, shrunk = table(fleet), table(fleet - {gone})
    p_old, b_old = old.slot_pairs()
    p_new, b_new = shrunk.slot_pairs()
    names_old, names_new = np.array(old.clusters), np.array(shrunk.clusters)
    held = names_old[p_old] == gone
    assert (names_new[p_new][held] == names_old[b_old][held]).all()
    untouched = ~held & (names_old[b_old] != gone)
    assert (names_new[p_new][untouched] == names_old[p_old][untouched]).all()
    assert (names_new[b_new][untouched] == names_old[b_old][untouched]).all()


@given(fleets.filter(lambda f: len(f) >= 3), sessions, st.data())
def test_target_is_the_backup_when_the_primary_is_down(fleet, ids, data):
    t = table(fleet)
    for s in ids:
        p = t.place(s)
        down = {p.primary} | data.draw(st.sets(st.sampled_from(sorted(fleet - {p.primary, p.backup}))))
        d = decide(t, s, fleet - down)
        assert (d.primary, d.backup, d.target, d.failover) == (p.primary, p.backup, p.backup, True)


@given(fleets.filter(lambda f: len(f) >= 3), sessions, st.data())
def test_target_equals_the_choice_over_the_healthy_set_alone(fleet, ids, data):
    healthy = data.draw(st.sets(st.sampled_from(sorted(fleet)), min_size=1))
    t, only_healthy = table(fleet), table(healthy)
    for s in ids:
        assert decide(t, s, healthy).target == only_healthy.place(s).primary


def test_no_healthy_cluster_gives_no_target():
    t = table({"a", "b", "c"})
    d = decide(t, "s", set())
    assert d.target is None and not d.failover
    assert decide(t, "s", {"a", "b", "c"}, exclude={"a", "b", "c"}).target is None


def test_weights_set_each_clusters_share():
    weights = {"big": 3.0, "mid": 2.0, "small": 1.0}
    t = PlacementTable(weights, slot_bits=16)
    primary, _ = t.slot_pairs()
    shares = np.bincount(primary, minlength=3) / len(primary)
    expected = np.array([weights[c] for c in t.clusters]) / sum(weights.values())
    # 65536 slots: the binomial standard deviation of each share is < 0.002.
    np.testing.assert_allclose(shares, expected, atol=0.01)


@pytest.mark.parametrize("weights, needle", [({}, "no clusters"), ({"a": 0.0}, "'a'"),
                                             ({"a": float("nan")}, "'a'"), ({"": 1.0}, "empty")])
def test_bad_weights_are_rejected_with_the_field_named(weights, needle):
    with pytest.raises(ValueError, match="weights") as err:
        PlacementTable(weights, slot_bits=4)
    assert needle in str(err.value)
