"""The drill's numbers on hand-built request records, against hand-computed values; SLO parsing and checks;
the report files. (The drill against real processes: tests/fleet.)"""

from __future__ import annotations

import json

import pytest

from services.cli.drill import report
from services.cli.drill.load import RequestRecord
from services.cli.drill.slo import parse_slo

FAULT_AT = 10.0
CLUSTERS = ["c0", "c1", "c2"]
# s0, s1, s2 live on c2 (backups c0, c1, c0); s3 lives on c0.
PLACEMENTS = {"s0": ("c2", "c0"), "s1": ("c2", "c1"), "s2": ("c2", "c0"), "s3": ("c0", "c1")}


def rec(session, turn, start, end, clusters, ttft=0.5, status=200, error="", attempt=0, prompt_tokens=100):
    return RequestRecord(session, turn, start, ttft, end, status, error, clusters, 4, prompt_tokens, 0, attempt)


def records() -> list[RequestRecord]:
    return [
        rec("s0", 0, 1, 2, ["c2"]),
        rec("s0", 1, 9, 12, ["c0"], prompt_tokens=150),     # in flight at the fault, failed over: moved to c0
        rec("s1", 0, 1, 2, ["c2"]),
        rec("s1", 1, 9, 11, ["c2", "c1"], prompt_tokens=140),  # mid-stream resume on c1: moved to c1
        rec("s2", 0, 1, 2, ["c2"]),
        rec("s2", 1, 11, 11.5, ["c1"], status=503, error="busy", ttft=None),  # client retried...
        rec("s2", 1, 12, 13, ["c1"], attempt=1, prompt_tokens=120),          # ...and it landed off its backup
        rec("s3", 0, 1, 2, ["c0"]),
        rec("s3", 1, 11, 12, [], status=200, error="cluster failed mid-stream", ttft=0.3),  # lost mid-stream
    ]


def test_summary_counts_moves_errors_and_shares():
    summary = report.summarize(records(), FAULT_AT, "c2", CLUSTERS, detect_at=11.5, sessions=5,
                               placements=PLACEMENTS)
    assert summary["requests"] == 8  # (session, turn) pairs; the retry is not a new request
    assert summary["errors"] == 1 and summary["errors_mid_stream"] == 1 and summary["errors_before_first_token"] == 0
    assert summary["client_retries"] == 1
    assert summary["lost_sessions"] == 2  # s3 failed a turn; a fifth session never ran
    assert summary["detect_s"] == 1.5
    assert summary["moved_sessions"] == 3 and summary["moved_off_backup"] == 1
    assert summary["reprefill_per_cluster"] == {"c0": 1, "c1": 2}
    assert summary["reprefill_tokens_per_cluster"] == {"c0": 150, "c1": 260}
    assert summary["reprefill_max_share"] == round(2 / 3, 4) and summary["reprefill_ideal_share"] == 0.5
    assert summary["reprefill_ratio"] == round((2 / 3) / 0.5, 3)
    assert summary["error_samples"] == ["cluster failed mid-stream"]


def test_without_placements_the_first_serving_cluster_is_home():
    summary = report.summarize(records(), FAULT_AT, "c2", CLUSTERS, None, 4)
    assert summary["moved_sessions"] == 3 and summary["moved_off_backup"] == 0 and summary["detect_s"] is None


@pytest.mark.parametrize("text,ok", [("errors<=0", True), ("detect_s <= 3.5", True), ("reprefill_ratio<1.2", True),
                                     ("errors=0", False), ("latency<=1", False), ("errors<=x", False)])
def test_slo_parsing(text, ok):
    if ok:
        parse_slo(text, report.SUMMARY_METRICS)
    else:
        with pytest.raises(ValueError):
            parse_slo(text, report.SUMMARY_METRICS)


def test_slo_checks_and_a_missing_value_fails():
    summary = {"errors": 0, "detect_s": None, "reprefill_ratio": 1.3}
    assert parse_slo("errors<=0", report.SUMMARY_METRICS).check(summary)["passed"]
    assert not parse_slo("detect_s<=3", report.SUMMARY_METRICS).check(summary)["passed"]
    assert not parse_slo("reprefill_ratio<=1.2", report.SUMMARY_METRICS).check(summary)["passed"]


def test_report_files(tmp_path):
    rs = records()
    summary = report.summarize(rs, FAULT_AT, "c2", CLUSTERS, 11.5, 4, PLACEMENTS)
    slos = [parse_slo("errors<=0", report.SUMMARY_METRICS).check(summary)]
    meta = {"fault": "kill-cluster", "cluster": "c2", "injected": "SIGKILL 3 processes", "fault_at_s": FAULT_AT,
            "sessions": 4, "turns": 2, "concurrency": 4}
    page = report.write(tmp_path, meta, summary, slos, rs, PLACEMENTS)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"] == json.loads(json.dumps(summary)) and len(data["requests"]) == len(rs)
    assert data["placements"]["s1"] == {"primary": "c2", "backup": "c1"}
    html = page.read_text()
    assert html.count("<svg") == 2 and "FAIL" in html and "c1 (2)" in html and "c0 (1)" in html
