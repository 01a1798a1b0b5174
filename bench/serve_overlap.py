"""Which kernels of the captured decode step run longer than in the eager forward, what runs beside them, and
the MLA decode kernel alone on the step's own inputs (GPU only).

    python -m bench.serve_overlap [--model mini] [--batch 64] [--context 4096] [--replays 5]
                                  [--variant name=ENV=value,...] [--out bench/results/serve_overlap.json]

One process, a bench.serve rank (`Rank`, random weights) with `--batch` rows filled to `--context` tokens:
1. the eager fast-path forward under torch.profiler (one stream, no side branch: nothing beside any kernel),
   the MLA kernel's inputs of each layer kept;
2. per `--variant` (env settings, the graphs captured again; "now" = the process's environment): the step's
   graph replayed back to back (device ms per replay), then `--replays` replays under the profiler: per kernel
   name its median us in the graph against the eager forward's and the us other kernels overlapped it; each
   MLA split kernel with what ran beside it;
3. the MLA kernel alone (`dispatch.mla_decode_paged`): on the step's inputs (index tensors as int64 and
   int32; at the step's lengths and rounded down to a multiple of 128 tokens: whole tiles in every split), and
   on the kernel bench's pool case (`kernels.perf.mla_cases.pool_case`; int32 and int64; random and zeroed
   latents): the kernel bench's graph of 20 calls (split + merge), the split kernel's median in profiled
   back-to-back calls, and after an L2 flush (a memset over 4x the L2, whose dirty lines the call then writes
   back) before each call.
Prints tables; writes JSON to --out and the profiled runs' chrome traces gzipped beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.kernel_overlap import by_name, compare, neighbours, table
from bench.serve_decode import apply_variant, parse_variant, replay_seconds
from bench.serve_rank import Rank, random_model, sync
from bench.serve_trace_gaps import Span, export_trace, spans
from k3core.presets import preset
from kernels import dispatch
from kernels.perf import harness, mla_cases

SPLIT = "_mla_split_kernel"
CALLS = 10  # profiled calls of the MLA kernel per case


def gpu_spans(fn: Callable[[], object], trace: Path | None = None) -> list[Span]:
    """The GPU ops of `fn()` under the profiler, sorted by start; the chrome trace gzipped at `trace`."""
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    return spans(export_trace(prof, trace))[2]


def split_us(ops: list[Span]) -> list[float]:
    return [s.end - s.start for s in ops if SPLIT in s.name]


def eager_forward(rank: Rank, rids: list[str], trace: Path) -> tuple[list[Span], list[tuple[tuple, dict]]]:
    """The eager fast-path forward's GPU ops (the step begun and ended) and each MLA layer's kernel call."""
    calls: list[tuple[tuple, dict]] = []
    original = dispatch.mla_decode_paged

    def keeping(q, cache, page_table, lengths, *args, **kwargs):
        calls.append(((q.clone(), cache, page_table.clone(), lengths.clone(), *args), kwargs))
        return original(q, cache, page_table, lengths, *args, **kwargs)

    inputs = rank.step_inputs(rids, rank.next_tokens(len(rids), 100))
    dispatch.mla_decode_paged = keeping
    try:
        ops = gpu_spans(lambda: rank.fast.decoder.forward(inputs), trace)
    finally:
        dispatch.mla_decode_paged = original
    rank.end_step(rids)
    return ops, calls


def graph_variant(rank: Rank, rids: list[str], replays: int, trace: Path) -> tuple[float, list[Span]]:
    """(device ms of one replay of the step's graph, back to back; the GPU ops of `replays` profiled replays)
    with the environment as set: one engine step first captures the graph again."""
    rank.decode(rids, rank.next_tokens(len(rids), 0))
    rank.decode(rids, rank.next_tokens(len(rids), 1))
    ms = 1e3 * statistics.median(replay_seconds(rank, len(rids), 20) for _ in range(5))
    graphs = rank.fast.graphs
    graph = graphs._get(graphs.bucket(len(rids))).graph
    ops = gpu_spans(lambda: [graph.replay() for _ in range(replays)], trace)
    return ms, ops


def mla_alone(call: tuple[tuple, dict], flush: torch.Tensor) -> dict:
    """The MLA kernel alone on one call's inputs: the kernel bench's graph of 20 calls (split + merge, us), the
    split kernel's median us in back-to-back profiled calls and with an L2 flush before each."""
    args, kwargs = call

    def run() -> None:
        dispatch.mla_decode_paged(*args, **kwargs)

    def flushed() -> None:
        for _ in range(CALLS):
            flush.zero_()
            run()

    graph_ms, _ = harness.time_ms(run)
    return {"graph20_us": 1e3 * graph_ms,
            "split_us": statistics.median(split_us(gpu_spans(lambda: [run() for _ in range(CALLS)]))),
            "split_flushed_us": statistics.median(split_us(gpu_spans(flushed)))}


def alone_cases(calls: list[tuple[tuple, dict]], batch: int, context: int) -> dict[str, dict]:
    """`mla_alone` on layer 0's step inputs (its page table and lengths as int64, the step image's type, and as
    int32; at the step's lengths and rounded down to whole tiles), and on the kernel bench's pool case (int32
    indices as the bench has them, and int64; random latents, then the same pages zeroed: the step's filled
    rows hold zeros, `Rank.fill`)."""
    flush = torch.empty(4 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    (q, cache, table, lengths, scale, *rest), kwargs = calls[0]
    q_s, cache_s, table_s, lengths_s = mla_cases.pool_case(batch, context)
    cases: list[tuple[str, tuple, Callable[[], object] | None]] = []
    for dtype in (torch.int64, torch.int32):
        name = str(dtype).removeprefix("torch.")
        for n in (lengths, (lengths // 128) * 128):  # whole 32-row tiles in each of 4 splits
            cases.append((f"step layer 0, {name}, lengths {int(n[0])}",
                          (q, cache, table.to(dtype), n.to(dtype), scale, *rest), None))
        cases.append((f"pool case {batch}x{context}, {name}, random",
                      (q_s, cache_s, table_s.to(dtype), lengths_s.to(dtype), scale), None))
    cases.append((f"pool case {batch}x{context}, int32, zeroed", (q_s, cache_s, table_s, lengths_s, scale),
                  cache_s.zero_))
    out = {}
    for name, args, prepare in cases:
        if prepare is not None:
            prepare()
        out[name] = r = mla_alone((args, kwargs), flush)  # kwargs: latent_dim (512 in both)
        print(f"  MLA alone, {name}: graph of 20 {r['graph20_us']:.1f} us/call, split {r['split_us']:.1f} us, "
              f"after an L2 flush {r['split_flushed_us']:.1f} us", flush=True)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=5, help="profiled graph replays per variant")
    parser.add_argument("--variant", action="append", default=[], help="name=ENV=value,... (repeatable)")
    parser.add_argument("--num-pages", type=int, default=16000)
    parser.add_argument("--out", default="bench/results/serve_overlap.json")
    args = parser.parse_args(argv)
    # what `Rank` reads of bench.serve's arguments
    args.device, args.prefix, args.increment, args.budget = "cuda", 0, 0, 8192
    args.contexts, args.batches, args.steps, args.hash_block = [args.context], [args.batch], 40, 512
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rank = Rank(random_model(preset(args.model), "cuda", torch.bfloat16), args.model, args, torch.bfloat16)
    rids = [f"overlap-{i}" for i in range(args.batch)]
    rank.fill(rids, args.context)
    for step in range(3):  # compiles, captures the graph, warms
        rank.decode(rids, rank.next_tokens(args.batch, step))
    eager, calls = eager_forward(rank, rids, out.with_name(f"{out.stem}_eager.json.gz"))
    eager_names = by_name(eager)
    print(f"eager forward: {len(eager)} GPU ops, MLA split us by layer {[round(u, 1) for u in split_us(eager)]}")
    result: dict = {"model": args.model, "batch": args.batch, "context": args.context,
                    "device": torch.cuda.get_device_name(), "eager_mla_split_us": split_us(eager), "variants": {}}
    variants = [parse_variant(v) for v in args.variant] or [("now", {})]
    base = {key: os.environ.get(key) for _, settings in variants for key in settings}
    for i, (name, settings) in enumerate(variants):
        apply_variant(rank, settings, base)
        ms, ops = graph_variant(rank, rids, args.replays, out.with_name(f"{out.stem}_graph{i}_{name}.json.gz"))
        rows = compare(by_name(ops, args.replays), eager_names)
        mla = neighbours(ops, SPLIT)
        print(f"variant {name} {settings}: replay {ms:.3f} ms; MLA split in the graph us "
              f"{[round(m['us'], 1) for m in mla[:10]]}")
        print(table(rows))
        for m in mla[:5]:
            print(f"  MLA split {m['us']:.1f} us; beside it (name, overlap us, start from its start): {m['beside']}")
        result["variants"][name] = {"settings": settings, "replay_ms": ms, "kernels": rows, "mla_split": mla}
        out.write_text(json.dumps(result, indent=1))
    apply_variant(rank, {}, base)
    result["mla_alone"] = alone_cases(calls, args.batch, args.context)
    out.write_text(json.dumps(result, indent=1))
    rank.finish(rids)
    return result


if __name__ == "__main__":
    main()
