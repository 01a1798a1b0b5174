"""bench/serve_ttft.py end to end on the CPU with `nano`: its rank is sized from the TTFT arguments alone
(a Namespace without decode contexts once crashed it before the first row), and the hit really comes from
the prefix cache: every prefix token is served by it, and the hit's counted matmul work is below the
uncached prompt's (its size is `prompt_flops`' own arithmetic, not checked here)."""

from __future__ import annotations

import json
import os
import sys

from bench import serve_ttft


def test_ttft_bench_runs_and_the_hit_serves_the_whole_prefix(tmp_path, monkeypatch):
    out = tmp_path / "ttft.json"
    monkeypatch.setattr(sys, "argv", ["serve_ttft", "--model", "nano", "--device", "cpu", "--prefix", "128",
                                      "--increment", "32", "--hash-block", "32", "--num-pages", "100",
                                      "--budget", "64", "--extrapolate", "512", "--out", str(out)])
    serve_ttft.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["prefix"] == 128 and row["increment"] == 32
    assert row["hit_tokens"] == 128  # the whole (hash-aligned) prefix came from the cache
    assert 0 < row["hit_tflop"] < row["uncached_tflop"]


def test_compare_measures_each_row_in_both_forms_and_checks_their_logits(tmp_path, monkeypatch):
    """--compare: a row per form, each with its own prefix (the `fast` row's prompt is uncached too: no
    hit on the `reference` row's entries) measured under its form's switches (the fast prefill runs only
    in the `fast` form); --check: the two forms' logits agree; the switches are restored after the run."""
    from k3core.layers import mla
    from services.engine import fast_prefill

    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the fast path, and with it the fast prefill, on the CPU
    monkeypatch.delenv("K3_PREFILL_FASTPATH", raising=False)
    out = tmp_path / "ttft.json"
    row_switches, fast_runs = [], []
    ttft, fast_forward = serve_ttft.ttft, fast_prefill.FastPrefill.forward

    def switches() -> tuple[str | None, bool]:
        return os.environ.get("K3_PREFILL_FASTPATH"), mla.PAD_VALUES_FOR_FLASH

    def spied_ttft(*args, **kwargs):
        row_switches.append(switches())
        return ttft(*args, **kwargs)

    def spied_forward(self, *args, **kwargs):
        fast_runs.append(switches())
        return fast_forward(self, *args, **kwargs)

    monkeypatch.setattr(serve_ttft, "ttft", spied_ttft)
    monkeypatch.setattr(fast_prefill.FastPrefill, "forward", spied_forward)
    prompts, prefill = [], serve_ttft._prefill

    def spied_prefill(rank, rid, *args, **kwargs):
        prompts.append(rid)
        return prefill(rank, rid, *args, **kwargs)

    monkeypatch.setattr(serve_ttft, "_prefill", spied_prefill)
    monkeypatch.setattr(sys, "argv", ["serve_ttft", "--model", "nano", "--device", "cpu", "--prefix", "64",
                                      "--increment", "16", "--hash-block", "32", "--num-pages", "100",
                                      "--budget", "64", "--compare", "--check", "--out", str(out)])
    serve_ttft.main()
    result = json.loads(out.read_text())
    assert [r["form"] for r in result["rows"]] == ["reference", "fast"]
    assert row_switches == [("0", False), ("1", True)]
    assert fast_runs and set(fast_runs) == {("1", True)}
    # the fast prefill's row-count warm-ups only in its own form's row (row 1), as a worker's warm-up
    row_count_warmups = [p for p in prompts if p.startswith("warm") and "r" in p[4:]]
    assert row_count_warmups == [f"warm1r{n}" for n in fast_prefill.WARMUP_ROWS]
    assert all(r["hit_tokens"] == 64 for r in result["rows"])
    check = result["check"]
    assert check["same_argmax"] and check["max_abs_diff"] < 1e-3 * max(1.0, check["scale"])
    assert mla.PAD_VALUES_FOR_FLASH and "K3_PREFILL_FASTPATH" not in os.environ


def test_ttft_profile_runs_and_its_sublayer_ranges_lie_inside_the_hit(tmp_path, monkeypatch):
    """bench.serve_ttft_profile on the CPU (nano, fast prefill): the host time of the forward is within its
    synced time, every attention layer kind has its labelled range and they sum to less than the profiled
    hit's wall time (nested, not double counted), and the tables and the trace are written."""
    from bench import serve_ttft_profile

    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    monkeypatch.delenv("K3_PREFILL_FASTPATH", raising=False)
    monkeypatch.setattr(sys, "argv", ["serve_ttft_profile", "--model", "nano", "--device", "cpu",
                                      "--prefix", "64", "--increment", "16", "--hash-block", "32", "--num-pages", "100",
                                      "--budget", "64", "--out", str(tmp_path)])
    serve_ttft_profile.main()
    result = json.loads((tmp_path / "ttft_profile.json").read_text())
    assert 0 < result["host_s"] <= result["synced_s"]
    labels = result["profile"]["sublayer_host_s"]
    assert set(labels) == {"prefill.kda", "prefill.mla"} and all(v > 0 for v in labels.values())
    assert sum(labels.values()) < result["profile"]["hit_wall_s"]
    written = {"ttft_profile_kernels.txt", "ttft_profile_host.txt", "ttft_profile_cprofile.txt",
               "ttft_profile_trace.json.gz"}
    assert written <= {p.name for p in tmp_path.iterdir()}
