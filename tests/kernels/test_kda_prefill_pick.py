"""kernels/perf/kda_prefill_tuning.pick_tuning: which per-kernel variants the device run combines (CPU only)."""

from __future__ import annotations

import json

from kernels.perf.kda_prefill_cases import selected_shapes
from kernels.perf.kda_prefill_tuning import VARIANTS, pick_from_files, pick_tuning

UT, REC = "_kda_chunk_ut_kernel", "_kda_chunk_recurrence_kernel"
SHAPES = ("B=1,T=32K,H=16", "B=8,T=4K,H=32")


def _rows(label: str, ut: float, rec: float, err: float = 4e-3, shapes=SHAPES) -> list[dict]:
    return [{"kernel": "kda_prefill_block", "shape": s, "impl": f"ours({label})", "ms": ut + rec,
             "extra": {"y_rel_err": err, "state_rel_err": err, "kernels_ms": {UT: ut, REC: rec}}} for s in shapes]


def test_each_kernel_takes_its_fastest_accurate_variant():
    rows = (_rows("default", 1.0, 0.8) + _rows("kb=16", 0.7, 0.9) + _rows("ut no cap", 0.6, 0.8, err=0.02)
            + _rows("few bv=32", 1.1, 0.6) + _rows("stages 2", 1.0, 0.7))
    # kb=16's recurrence time and few bv=32's UT time are noise of kernels they do not tune; ut no cap is wrong.
    assert pick_tuning(rows) == {"k_block": 16, "few_block_v": 32}


def test_a_variant_within_the_margin_or_missing_a_shape_is_not_picked():
    rows = _rows("default", 1.0, 0.8) + _rows("kb=16", 0.98, 0.8) + _rows("stages 2", 1.0, 0.1, shapes=SHAPES[:1])
    assert pick_tuning(rows) == {}
    assert pick_tuning([]) == {}


def test_rows_files_are_json_lines_and_a_missing_file_adds_none(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows("default", 1.0, 0.8) + _rows("kb=16", 0.5, 0.8)))
    assert pick_from_files([str(path), str(tmp_path / "none.jsonl")]) == {"k_block": 16}


def test_every_variant_names_a_kernel_and_shapes_are_selected_by_prefix(monkeypatch):
    assert all(kernel is None or kernel.startswith("_kda_") for _, _, kernel in VARIANTS)
    monkeypatch.setenv("KDA_PREFILL_SHAPES", "B=1,T=32K;varlen")
    assert [s[0][:9] for s in selected_shapes()] == ["B=1,T=32K", "varlen 8 "]
