"""Issue 8, checked for real (slow: ~5-8 minutes here): `k3 drill kill-cluster` against a 3-cluster local
fleet with 300 sessions. No request lost, detection within lease TTL + 1 s, re-prefill per survivor within
1.2x of the ideal, the report (JSON + HTML) shows it, and the exit code reflects the SLOs: every SLO of
the issue passes and one impossible SLO fails, so the drill exits 1 naming only that one."""

from __future__ import annotations

import json

import pytest

from tests.fleet.k3cli import k3, logs, running_fleet

pytest.importorskip("services.decode.server")

LEASE_TTL_S = 2
ISSUE_SLOS = ["errors<=0", "lost_sessions<=0", "client_retries<=0", f"detect_s<={LEASE_TTL_S + 1}",
              "moved_off_backup<=0", "reprefill_ratio<=1.2"]
IMPOSSIBLE = "ttft_p99_ms<=1"


@pytest.mark.slow
def test_kill_cluster_drill_300_sessions(tmp_path):
    home, out = tmp_path / "k3home", tmp_path / "report"
    with running_fleet(home, "--clusters", "3", "--lease-ttl-s", str(LEASE_TTL_S), "--no-smoke"):
        done = k3(home, "drill", "kill-cluster", "--cluster", "c2", "--sessions", "300", "--turns", "2",
                  "--max-tokens", "4", "--fault-after-s", "3", "--fault-after-requests", "1",
                  "--report-dir", str(out), *(a for s in ISSUE_SLOS + [IMPOSSIBLE] for a in ("--slo", s)),
                  timeout=900)
        assert (out / "report.json").exists(), done.stdout + done.stderr + logs(home)
    assert done.returncode == 1, done.stdout
    data = json.loads((out / "report.json").read_text())
    verdicts = {s["slo"].split("<")[0]: s["passed"] for s in data["slos"]}
    assert verdicts == {**{s.split("<")[0]: True for s in ISSUE_SLOS}, "ttft_p99_ms": False}, data["slos"]
    summary = data["summary"]
    assert summary["requests"] == 600 and summary["errors"] == 0 and summary["moved_sessions"] > 0
    assert sum(summary["reprefill_per_cluster"].values()) == summary["moved_sessions"]
    html = (out / "report.html").read_text()
    assert "Re-prefill load per surviving cluster" in html and "c0 (" in html and "c1 (" in html
    assert html.count("PASS") == len(ISSUE_SLOS) and html.count("FAIL") == 1
