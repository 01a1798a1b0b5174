"""bench/kernels.py: an --only run replaces the rows of the kernels it measured and keeps the others."""

from __future__ import annotations

import pytest

from bench.kernels import merged_rows, summarise
from kernels.perf.harness import Row


def _previous() -> dict:
    rows = [Row("kda_decode_step", "B=64", "ours", 0.1, bytes=4e8), Row("mla_decode_paged", "B=64", "ours", 1.0,
                                                                          bytes=1e9)]
    as_json = [r.as_dict() for r in rows]
    as_json[0]["flops"] = 0.0  # a field older files carry and Row no longer has
    return {"ceilings": {"copy_bytes_per_s": 4e12}, "rows": as_json}


def test_only_run_replaces_its_kernels_and_keeps_the_rest():
    fresh = [Row("mla_decode_paged", "B=64", "ours(new)", 0.5, bytes=1e9),
             Row("mla_decode_paged", "B=64", "torch SDPA", 20.0, bytes=1e9)]
    rows, ceilings = merged_rows(fresh, 5e12, _previous())
    assert [(r.kernel, r.impl) for r in rows] == [("kda_decode_step", "ours"), ("mla_decode_paged", "ours(new)"),
                                                 ("mla_decode_paged", "torch SDPA")]
    assert ceilings == [4e12, 5e12, 5e12]  # each row keeps the ceiling of the run that measured it
    summary = {s["kernel"]: s for s in summarise(rows, ceilings)}
    assert summary["kda_decode_step"]["ours_copy_bw_frac"] == pytest.approx(4e8 / 0.1e-3 / 4e12)
    assert summary["mla_decode_paged"]["ours_copy_bw_frac"] == pytest.approx(1e9 / 0.5e-3 / 5e12)
    assert summary["mla_decode_paged"]["peers"]["torch SDPA"]["speedup"] == pytest.approx(40.0)


def test_full_run_keeps_nothing_old():
    fresh = [Row("kda_decode_step", "B=64", "ours", 0.2)]
    rows, ceilings = merged_rows(fresh, 5e12, None)
    assert rows == fresh and ceilings == [5e12]
