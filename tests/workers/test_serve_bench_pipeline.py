"""bench.serve's decode rows report how their timed steps ran (`PipelineMetrics` differences) and the slowest
device-clock cycles with their steps' modes (`StepClock`), on the CPU with `nano` and the fast path."""

from __future__ import annotations

import json
import sys
import time

from bench import serve, serve_engine
from bench.step_clock import PARTS


def test_a_row_whose_rows_cross_a_block_reports_one_overlap_step(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the look-ahead runs on the fast path (on the CPU: eager)
    out = tmp_path / "serve.json"
    # nano's pool blocks hold 512 tokens (bench.serve's layout): rows at 505 tokens pass 5 untimed steps (3 warm-up,
    # the heap freeze, 2 settling), then the 3rd timed step's input sits at position 512, the first of a new
    # block (one step in the overlap)
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "2", "--contexts",
                                      "505", "--steps", "6", "--prefix", "0", "--peer-batches", "--num-pages", "200",
                                      "--out", str(out)])
    serve.main()
    row = json.loads(out.read_text())["decode"][0]
    path = row["critical_path_us"]
    assert path["pipeline"] == {"steps": {"lookahead": 5, "overlap": 1}, "lookahead": {"block_crossing": 1},
                                "overlap": {}}
    slowest = path["slowest_cycles"]
    assert len(slowest) == 3 and [s["cycle_us"] for s in slowest] == sorted((s["cycle_us"] for s in slowest),
                                                                           reverse=True)
    assert {s["mode"] for s in slowest} <= {"lookahead", "overlap"}


def test_the_slowest_cycles_carry_the_mode_the_engine_counted_after_each_launch():
    """Hand-timed steps (CPU: one wall clock): the step whose launch sleeps longest is the slowest cycle, with
    the mode told right after its launch and its parts (adding up to the cycle, the sleep in its launch); a
    launch the clock does not keep (no tokens-ready mark) takes no mode."""
    clock = serve_engine.StepClock()
    for k, (mode, pause) in enumerate([("plain", 0.001), ("lookahead", 0.001), ("overlap", 0.02),
                                       ("lookahead", 0.005), ("lookahead", 0.001)]):
        if k != 4:
            clock.tokens_ready()
        clock.launching()
        time.sleep(pause)
        clock.launched()
        clock.mode(mode)
        clock.sampled()
    assert clock.modes == ["plain", "lookahead", "overlap", "lookahead"]
    slowest = clock.critical_path(float("nan"))["slowest_cycles"]
    assert [(s["step"], s["mode"]) for s in slowest] == [(2, "overlap"), (3, "lookahead"), (1, "lookahead")]
    assert slowest[0]["cycle_us"] >= 2e4
    for cycle in slowest:
        assert tuple(cycle["parts_us"]) == PARTS
        assert abs(sum(cycle["parts_us"].values()) - cycle["cycle_us"]) < 1e-6 * cycle["cycle_us"]
    assert slowest[0]["parts_us"]["launch"] >= 2e4
