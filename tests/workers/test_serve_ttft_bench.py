"""bench/serve_ttft.py end to end on the CPU with `nano`: its rank is sized from the TTFT arguments alone
(a Namespace without decode contexts once crashed it before the first row), and the hit really comes from
the prefix cache: every prefix token is served by it, and the hit's counted matmul work is below the
uncached prompt's (its size is `prompt_flops`' own arithmetic, not checked here)."""

from __future__ import annotations

import json
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
