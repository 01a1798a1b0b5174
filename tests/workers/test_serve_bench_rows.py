"""bench/serve.py's decode rows on the CPU with `nano`: every row's engine gives its heap-freeze hold back
(a frozen engine is never collected, so a sweep would keep every earlier row's engine alive), and each row
reports a step time and its roofline."""

from __future__ import annotations

import json
import sys

from bench import serve, serve_engine
from services.engine import heap


def test_decode_rows_release_the_heap_freeze(tmp_path, monkeypatch):
    out = tmp_path / "serve.json"
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "2", "3",
                                      "--contexts", "64", "--steps", "2", "--prefix", "0", "--peer-batches",
                                      "--num-pages", "200", "--out", str(out)])
    holds = heap._holders  # another test's running engine may hold one
    freezes = []
    freeze = serve_engine.freeze_startup_heap
    monkeypatch.setattr(serve_engine, "freeze_startup_heap", lambda: freezes.append(freeze()))
    serve.main()
    assert len(freezes) == 2 and heap._holders == holds  # both rows froze the heap once and gave the hold back
    rows = json.loads(out.read_text())["decode"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 64), (3, 64)]
    assert all(r["loop"] == "engine" for r in rows)  # the engine's loop ran (not the rank's fallback)
    assert all(r["step_s"] > 0 and r["roofline_step_s"] > 0 for r in rows)
