"""How a CUDA graph's launch cost grows with its node count, untraced (the profiler inflates graph launches):
whether capturing the decode forward in pieces (a small first graph the device starts on while the host
launches the rest) could shorten the decode step's idle path.

    python -m bench.serve_launch_probe [--nodes 1 16 64 262 512] [--reps 50] [--out bench/results/serve_launch_probe.json]

Per node count: a graph of an event-record node then that many tiny kernels (`add_` on 1024 floats). With the
device idle: the host time of `replay()` and the device's start latency (an event recorded before the call to
the graph's own first-node event: what the device waits after the host decides to launch); then the same call
with the device busy (a launch queued behind a long kernel: its host time only). Medians over `--reps`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kernels.perf import harness


def probe(nodes: int, reps: int) -> dict:
    x = torch.zeros(1024, device="cuda")
    big = torch.empty(1 << 28, device="cuda")
    first = torch.cuda.Event(enable_timing=True, external=True)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        first.record()
        for _ in range(nodes):
            x.add_(1)
    idle_host, start, busy_host = [], [], []
    before, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        before.record()
        t0 = time.perf_counter()
        graph.replay()
        idle_host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        start.append(before.elapsed_time(first) / 1e3)
        big.mul_(1.0)  # ~0.5 ms of device work: the next launch is queued behind it
        t0 = time.perf_counter()
        graph.replay()
        busy_host.append(time.perf_counter() - t0)
    # back to back: the graph's device time alone
    device_ms, _ = harness.time_ms(graph.replay, inner=reps, reps=1, warmup=0, graph=False)
    med = [1e6 * statistics.median(v[3:]) for v in (idle_host, start, busy_host)]
    return {"nodes": nodes, "idle_call_us": med[0], "start_latency_us": med[1], "busy_call_us": med[2],
            "device_us": 1e3 * device_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 16, 64, 262, 512])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default="bench/results/serve_launch_probe.json")
    args = parser.parse_args()
    rows = [probe(n, args.reps) for n in args.nodes]
    print(f"{'nodes':>6} {'idle call us':>13} {'start latency us':>17} {'busy call us':>13} {'device us':>10}")
    for r in rows:
        print(f"{r['nodes']:>6} {r['idle_call_us']:>13.1f} {r['start_latency_us']:>17.1f} {r['busy_call_us']:>13.1f} "
              f"{r['device_us']:>10.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                              indent=1))


if __name__ == "__main__":
    main()
