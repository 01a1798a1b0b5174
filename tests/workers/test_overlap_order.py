"""The overlap's host-side helpers against independent definitions. `decode_overlap.plain_order`, the order in which an overlapped step reserves the blocks of the rows that
cross one: it must be the plain schedule's order (so pages are allocated as a plain step allocates them),
and is checked here against the scheduler's own rule (a stable sort of `running` by arrival), with ties,
any subset of rows and any order of the step's rows. `stop_hits`, the stop check's membership test, against
`np.isin` (both of its branches: a few ids compared one by one, many through `np.isin`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.decode_overlap import plain_order, stop_hits
from services.engine.request import EngineRequest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=12), st.data())
def test_rows_are_ordered_as_the_plain_schedule_visits_their_requests(arrivals, data):
    running = [EngineRequest(f"r{k}", [1], None, lambda out: None, arrival=float(a))  # type: ignore[arg-type]
               for k, a in enumerate(arrivals)]
    requests = data.draw(st.permutations(running))  # the step's rows: any order of the same requests
    rows = data.draw(st.lists(st.integers(0, len(requests) - 1), unique=True) if requests else st.just([]))
    crossing = {id(requests[i]) for i in rows}
    # the oracle: the scheduler's stable sort by arrival over `running`, restricted to the crossing rows
    visited = [req for req in sorted(running, key=lambda r: r.arrival) if id(req) in crossing]
    assert [requests[i] for i in plain_order(rows, requests, running)] == visited


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=40), st.lists(st.integers(0, 20), max_size=12, unique=True))
def test_stop_hits_is_membership_in_the_stop_ids(tokens, stop_ids):
    tokens_array, ids = np.array(tokens, dtype=np.int64), np.array(stop_ids, dtype=np.int64)
    hits = stop_hits(tokens_array, ids)
    assert hits.dtype == bool and hits.tolist() == [t in stop_ids for t in tokens]
