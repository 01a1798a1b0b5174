"""Where the decode step's host gap goes: one decode row of bench/serve.py (the engine's own loop,
`bench.serve_engine`) traced with `torch.profiler` for a few steps, split per step by bench/serve_trace_gaps.py.

    python -m bench.serve_trace [--model mini] [--batches 64 256] [--context 1024] [--steps 5]
                                [--out bench/results/serve_trace.json]

Per batch: first the untraced row exactly as bench.serve measures it (step ms, fwd ms, graph replay ms),
then the same row again with the engine's `k3.*` labels on (`services.engine.trace_labels`) and the profiler
recording `--steps` engine steps (CPU ops, plus CUDA kernels and copies on a GPU; record_shapes off) after
the engine's warm-up (its graph capture), `--skip` untraced steps and one profiler warm-up step. Prints per
step its wall time, the labels' coverage of it, the GPU's busy time and idle intervals (> `--gap-us`), then
each kind of gap (named by the GPU ops either side) with the host ranges overlapping it, summed over the
steps. The chrome trace is written gzipped next to the JSON (open it in chrome://tracing or Perfetto).
On the CPU (no GPU ops) it reports the labelled host ranges per step; K3_DECODE_FASTPATH=1 puts the decode
fast path and the host/device overlap on there, as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench.serve_decode import decode_row
from bench.serve_engine import engine_decode
from bench.serve_rank import Rank, random_model
from bench.serve_trace_gaps import breakdown, export_trace, report
from k3core.presets import preset
from services.engine import trace_labels
from services.engine.engine import Engine

ENGINE_WARMUP = 3  # bench.serve_engine's untimed steps (the first captures the batch's graph)


def traced_row(rank: Rank, batch: int, context: int, args: argparse.Namespace, trace_path: Path) -> dict:
    """The row's engine loop with `args.steps` steps profiled; the chrome trace (gzipped) at `trace_path`;
    the breakdown."""
    rids = [f"trace-{batch}-{context}-{i}" for i in range(batch)]
    cuda = torch.cuda.is_available()
    trace: dict = {}

    def save(prof: profile) -> None:
        trace.update(export_trace(prof, trace_path))

    # The profiler's step counter is the engine step's: steps 1..ENGINE_WARMUP + skip stay unprofiled.
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   schedule=schedule(skip_first=ENGINE_WARMUP + args.skip + 1, wait=0, warmup=1, active=args.steps,
                                     repeat=1),
                   on_trace_ready=save, record_shapes=False, with_stack=args.with_stack)
    step = Engine._step

    def profiled_step(engine: Engine) -> None:
        prof.step()  # ends the previous `ProfilerStep#k` range, opens this step's
        step(engine)

    Engine._step = profiled_step  # type: ignore[method-assign]
    try:
        with trace_labels.tracing(), prof:
            # + 1: the step whose `prof.step()` closes the last profiled one
            engine_decode(rank, rids, context, args.skip + 1 + args.steps + 1)
    finally:
        Engine._step = step  # type: ignore[method-assign]
        rank.finish(rids)
    if not trace:
        raise RuntimeError("the profiler recorded no trace")
    return breakdown(trace, args.gap_us)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="profiled engine steps")
    parser.add_argument("--skip", type=int, default=2, help="untraced engine steps after the warm-up")
    parser.add_argument("--row-steps", type=int, default=10, help="steps of the untraced bench.serve row")
    parser.add_argument("--gap-us", type=float, default=5.0, help="shortest GPU idle interval reported")
    parser.add_argument("--with-stack", action="store_true", help="Python stacks in the trace (larger)")
    parser.add_argument("--table-context", type=int, default=4096,
                        help="the page tables' length (the input image's size) is the serve sweep's at its longest context")
    parser.add_argument("--num-pages", type=int, default=16000)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--out", default="bench/results/serve_trace.json")
    args = parser.parse_args(argv)
    # what `Rank` reads of bench.serve's arguments: no TTFT prompt, one context
    args.prefix, args.increment, args.budget, args.contexts = 0, 0, 8192, [args.context]
    args.steps = max(args.steps, 1)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.device == "cpu":  # under the profiler each op split over this CPU's OpenMP threads took ~5 ms
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    # Rank sizes its sequences for `steps` more tokens than the context: both rows' steps and warm-ups
    longest = argparse.Namespace(**{**vars(args), "steps": max(args.row_steps, args.skip + args.steps + 2) + 4,
                                    "contexts": [args.context, args.table_context]})
    rank = Rank(random_model(preset(args.model), args.device, dtype), args.model, longest, dtype)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": args.model, "device": f"{device}, torch {torch.__version__}", "context": args.context,
                    "fast_path": rank.fast is not None, "cuda_graphs": bool(rank.fast and rank.fast.graphs),
                    "decode_overlap": os.environ.get("K3_DECODE_OVERLAP", "1") != "0", "rows": []}
    print(f"model {args.model} on {device}; fast path {result['fast_path']}, graphs {result['cuda_graphs']}, "
          f"overlap {result['decode_overlap']}", flush=True)
    for batch in args.batches:
        wall, forward, replay, path, _ = decode_row(rank, batch, args.context, args.row_steps, "row")
        print(f"batch {batch} ctx {args.context}: step {1e3 * wall:.3f} ms, fwd {1e3 * forward:.3f} ms, replay "
              f"{1e3 * replay:.3f} ms (bench.serve's row, untraced, {args.row_steps} steps)", flush=True)
        trace_path = out.with_name(f"{out.stem}_b{batch}_c{args.context}.json.gz")
        summary = traced_row(rank, batch, args.context, args, trace_path)
        print(report(summary), flush=True)
        # Integrity: the GPU ops recorded in a step must hold about one replay (some CUPTI setups drop the
        # kernels of graph replays: the gaps would then be the whole step).
        busy = statistics.median(r["gpu_busy_us"] for r in summary["steps"]) / 1e6
        recorded = busy / replay if replay == replay else float("nan")  # NaN without CUDA graphs
        if recorded == recorded:
            print(f"GPU ops recorded per step: {1e3 * busy:.3f} ms = {recorded:.0%} of the replay"
                  + ("" if recorded > 0.8 else ": KERNELS MISSING from the trace, its gaps are not idle time"))
        result["rows"].append({"batch": batch, "step_s": wall, "forward_s": forward, "replay_s": replay,
                               "critical_path_us": path, "recorded_of_replay": recorded, "trace": str(trace_path),
                               **summary})
        out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
