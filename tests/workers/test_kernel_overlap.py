"""bench/kernel_overlap.py on hand-built timelines (the overlaps worked out by hand): what ran beside each kernel,
the per-name table of a run of several replays, and the graph-versus-eager comparison."""

from __future__ import annotations

import pytest

from bench.kernel_overlap import beside, by_name, compare, neighbours
from bench.serve_trace_gaps import Span

# One "replay" twice: the MLA split [10, 100) with a side-branch kernel [5, 20) already running at its start and
# another [90, 95) near its end; the GEMM after it alone.
REPLAY = [("gemm", 0, 10), ("side_a", 5, 20), ("_mla_split_kernel", 10, 100), ("side_b", 90, 95), ("gemm", 100, 108)]
TWO = sorted((Span(n, s + off, e + off) for off in (0, 1000) for n, s, e in REPLAY), key=lambda s: s.start)


def test_beside_is_symmetric_and_exact():
    found = beside(TWO[:5])
    as_names = [sorted((o.name, us) for o, us in others) for others in found]
    assert as_names == [[("side_a", 5)], [("_mla_split_kernel", 10), ("gemm", 5)],
                        [("side_a", 10), ("side_b", 5)], [("_mla_split_kernel", 5)], []]


def test_by_name_per_replay():
    stats = by_name(TWO, runs=2)
    assert stats["gemm"] == {"count": 2, "median_us": pytest.approx(9), "total_us": pytest.approx(18),
                             "beside_us": pytest.approx(5)}
    assert stats["_mla_split_kernel"]["beside_us"] == pytest.approx(15)
    assert stats["_mla_split_kernel"]["count"] == 1


def test_compare_orders_by_extra_time_per_run():
    eager = {"gemm": {"median_us": 9.0}, "_mla_split_kernel": {"median_us": 80.0}}
    rows = compare(by_name(TWO, runs=2), eager)  # side_a / side_b: not in the eager run, left out
    assert [r["name"] for r in rows] == ["_mla_split_kernel", "gemm"]
    assert rows[0]["extra_us"] == pytest.approx(10) and rows[1]["extra_us"] == pytest.approx(0)


def test_neighbours_of_the_split():
    rows = neighbours(TWO, "_mla_split")
    assert len(rows) == 2
    assert rows[0]["us"] == 90
    assert rows[0]["beside"] == [["side_a", 10, -5], ["side_b", 5, 80]]
