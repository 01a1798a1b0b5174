"""bench/serve.py's decode rows on the CPU with `nano`: every row's engine gives its heap-freeze hold back
(a frozen engine is never collected, so a sweep would keep every earlier row's engine alive), and each row
reports a step time and its roofline."""

from __future__ import annotations

import json
import os
import sys

from bench import serve, serve_decode, serve_engine
from services.engine import heap
from services.engine.decode_fastpath import DecodeFastPath


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


def test_variants_measure_each_row_under_their_settings_then_restore_the_environment(tmp_path, monkeypatch):
    """--variant: every decode row once per variant in turn, each under its settings over the starting
    environment (a name the variant does not set keeps its starting value, or stays unset), and the
    starting environment back after the sweep."""
    out = tmp_path / "serve.json"
    monkeypatch.setenv("K3_BENCH_T_KEPT", "start")
    monkeypatch.delenv("K3_BENCH_T_SET", raising=False)
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "2",
                                      "--contexts", "64", "--steps", "2", "--prefix", "0", "--peer-batches",
                                      "--num-pages", "200", "--out", str(out),
                                      "--variant", "b=", "--variant", "a=K3_BENCH_T_SET=1,K3_BENCH_T_KEPT=a"])
    seen = []
    row = serve.decode_sweep_row

    def spied_row(*args, **kwargs):
        seen.append((args[-1], os.environ.get("K3_BENCH_T_SET"), os.environ.get("K3_BENCH_T_KEPT")))
        return row(*args, **kwargs)

    monkeypatch.setattr(serve, "decode_sweep_row", spied_row)
    serve.main()
    assert seen == [("b", None, "start"), ("a", "1", "a")]
    assert [r["variant"] for r in json.loads(out.read_text())["decode"]] == ["b", "a"]
    assert os.environ["K3_BENCH_T_KEPT"] == "start" and "K3_BENCH_T_SET" not in os.environ


def test_the_profile_runs_after_every_timed_row(tmp_path, monkeypatch):
    """--profile runs torch.profiler, which leaves CUPTI attached to the process (later graph launches cost the
    host more): it must come after the timed decode rows, never before them."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the profile needs the fast path (on the CPU: eager)
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "2", "3",
                                      "--contexts", "64", "--steps", "2", "--prefix", "0", "--peer-batches",
                                      "--num-pages", "200", "--profile", "2", "--out", str(tmp_path / "s.json")])
    order = []
    row = serve.decode_sweep_row
    monkeypatch.setattr(serve, "decode_sweep_row", lambda *a, **k: order.append("row") or row(*a, **k))
    monkeypatch.setattr(serve, "profile_forward", lambda *a, **k: order.append("profile") or {"batch": a[1]})
    serve.main()
    assert order == ["row", "row", "profile"]


def test_step_clock_parts_add_up_to_the_cycle():
    """StepClock (CPU: one wall clock): between two launched steps, draw + wake + to_launch + launch is the
    forward-end-to-forward-end cycle, each part is the interval it names (hand-timed sleeps), and a graph
    replay's time comes off `launch` alone."""
    import time

    clock = serve_engine.StepClock()
    pause = {"draw": 0.004, "wake": 0.002, "to_launch": 0.003, "launch": 0.005}
    for _ in range(2):
        clock.tokens_ready()
        time.sleep(pause["to_launch"])
        clock.launching()
        time.sleep(pause["launch"])
        clock.launched()
        time.sleep(pause["draw"])
        clock.sampled()
        time.sleep(pause["wake"])
    path = clock.critical_path(float("nan"))
    parts = sum(path[f"{name}_us"] for name in pause)
    assert abs(parts - path["cycle_us"]) < 1e-6 * path["cycle_us"]
    assert all(path[f"{name}_us"] >= 1e6 * seconds for name, seconds in pause.items())
    assert path["cycle_us"] < 1e6 * (sum(pause.values()) + 0.05)
    assert abs(clock.critical_path(0.001)["launch_us"] - (path["launch_us"] - 1e3)) < 1e-6


def test_rows_whose_experts_follow_the_tokens_read_the_feed(tmp_path, monkeypatch):
    """With the draw in the graph (the default) the device reads the greedy argmax, one token for every row, not
    the bench's feed. Where the experts read follow the tokens (nano: batch 2 grouped, batch 8 routed, the
    default; batch 1 reads top-k experts whatever its token) the feed must be published over the argmax after
    every draw, so the device reads it; elsewhere nothing is published (an all-greedy draw is in `drawn`)."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the fast path owns the switch (on the CPU: eager)
    monkeypatch.delenv("K3_DENSE_EXPERTS", raising=False)
    monkeypatch.delenv("K3_DECODE_DRAW_IN_GRAPH", raising=False)
    out = tmp_path / "serve.json"
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "1", "2", "8",
                                      "--contexts", "64", "--steps", "2", "--prefix", "0", "--peer-batches",
                                      "--num-pages", "300", "--out", str(out)])
    published, rows = [], []
    publish, row = DecodeFastPath.publish, serve_decode.decode_row
    monkeypatch.setattr(DecodeFastPath, "publish", lambda self, tokens: published.append(tokens.tolist()) or
                        publish(self, tokens))

    def spied_row(rank, batch, *args):
        before = len(published)
        result = row(rank, batch, *args)
        feeds = [rank.next_token_array(batch, n).tolist() for n in range(1, 64)]
        rows.append((batch, rank.fast.draw_in_graph, [p in feeds for p in published[before:]]))
        return result

    monkeypatch.setattr(serve_decode, "decode_row", spied_row)
    serve.main()
    steps = 2 + serve_engine.WARM_STEPS + serve_engine.SETTLE_STEPS
    assert [(batch, on, len(fed)) for batch, on, fed in rows] == [(1, True, 0), (2, True, steps), (8, True, steps)]
    assert all(all(fed) for _, _, fed in rows)  # every publish carried a feed, never the argmax
    decoded = json.loads(out.read_text())["decode"]
    for r in decoded:  # the routing check after each row: nano's 16 experts, top-4, each picked once a token
        routing = r["routing"]
        assert routing["experts"] == 16 and 4 <= routing["experts_touched_min"] <= min(16, 4 * r["batch"])
        assert 1 <= routing["max_expert_load"] <= r["batch"]
    labels = [(r["batch"], r["variant"]) for r in decoded]
    assert labels == [(1, ""), (2, "(feed published over the graph's argmax)"),
                      (8, "(feed published over the graph's argmax)")]
    assert "K3_DECODE_DRAW_IN_GRAPH" not in os.environ


def test_a_row_whose_routing_collapsed_is_labelled_not_comparable(tmp_path, monkeypatch):
    """A row whose form reads only the picked experts, where the routing check found a layer reading under half
    the experts the roofline counts (nano batch 8: min(16, 8 x 4) = 16), says its ratio is not comparable; the
    same routing on the dense form (its bytes do not follow the routing) is not labelled."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    monkeypatch.delenv("K3_DECODE_DRAW_IN_GRAPH", raising=False)
    monkeypatch.setattr(serve_decode, "row_routing",
                        lambda *a: {"experts_touched_min": 7, "experts": 16, "max_expert_load": 8})
    out = tmp_path / "serve.json"
    monkeypatch.setattr(sys, "argv", ["serve", "--model", "nano", "--device", "cpu", "--batches", "8",
                                      "--contexts", "64", "--steps", "2", "--prefix", "0", "--peer-batches",
                                      "--num-pages", "300", "--out", str(out), "--variant", "routed=",
                                      "--variant", "dense=K3_DENSE_EXPERTS=tma-down"])
    serve.main()
    labels = [r["variant"] for r in json.loads(out.read_text())["decode"]]
    assert labels == ["routed (feed published over the graph's argmax) (NOT comparable: routing collapsed, 7 of "
                      "the 16 experts the roofline counts read in a layer)", "dense"]
