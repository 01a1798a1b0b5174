"""Host time of one engine decode step (the GPU idles through it), on this CPU, per stage.

    python -m bench.serve_host [--model mini] [--batches 1 16 64 256] [--context 1024] [--steps 60]
                               [--label after] [--out bench/results/serve_host.json]

Drives the real engine step (`Engine._step`: scheduler, executor, the decode fast path's host side through
`DecodeGraphs.staging` / `launch`, batched sampling, output processing, the cache manager's calls) on B requests at
`context` tokens. Only the forward is replaced, by `StandInGraphs` (bench/serve_host_standins.py): a STAND-IN
for the captured CUDA graph whose replay does nothing and whose logits are a static tensor, so what is timed
is host work only. The real forward cannot run here; the model and the page store live on the meta device
(shapes and page ids are the preset's, no bytes; the store's fingerprints are stubbed: zeros, see
`build_engine`). The stand-in logits are bf16 (the graph's dtype) with `--vocab` columns (default 64, not
the preset's 163840): on a GPU the cast and argmax over them are device work, which on this CPU would be timed
as host work (at 1024 columns and batch 256 the CPU's bf16 argmax alone takes ~1 ms). Greedy rows, no
tokenizer (the mini preset's vocabulary has none here).

Stages (ms per step, p50 and p99 over `--steps` timed steps after warm-up):
- schedule: `Scheduler.schedule` (plain steps; an overlapped step's few manager calls fall in "other")
- build: `DecodeInputBuilder.prepare` / `compact` (the step's int64 input image but its tokens)
- launch: `DecodeFastPath.launch` (staging copy, stand-in replay)
- executor: the rest of `Executor.execute` (manager pre_forward / forward_done / commit_step)
- sample: `sample_rows_async` and the wait for its tokens (one argmax, one host copy for greedy rows)
- accept: `Engine._take` / `_take_rows` (output processing, metrics, append_tokens)
- emit: `Engine._flush`, the hand-over of outputs to their streams
- step: the whole `Engine._step`; "other" is what none of the above covers (gauges, the step histogram,
  an overlapped step's stop check, finishes and reserves)
- idle: from the moment a step's tokens are on the host to the next step's replay: the host time the GPU
  waits through (everything else runs while a graph computes). With the overlap (default) that is the stop
  check and the next step's launch; with K3_DECODE_OVERLAP=0 (the plain loop) it is the whole step but the
  executor's post-forward calls and the hand-over.
- to_launch: the part of idle before `DecodeFastPath.launch` is called, i.e. the engine's own Python on that
  path; the rest of idle is the launch (here the stand-in's input copy is a CPU memcpy; on a GPU an async H2D).
Per batch also `prepare_alone` (the input build with no other thread about) and `stream_burst` (the streams'
loop handing one output to each of B readers, `OutputQueue` against `asyncio.Queue`: bench/serve_host_costs.py).
Each request streams into a real `RequestStream` on an event loop thread (the service's hand-over: its
loop's mailbox, woken once per step's burst, `handover.py`), drained by a task per request as the servicer
does (without gRPC).
The peer each stage is compared against is the same stage of the `--peer` run in the JSON (default
`before`). Then `sample_rows` alone on 1 and 64 temperature > 0 rows over the preset's full vocabulary
(`sampled_row`, `sampled_rows_64`): device work on a GPU, host CPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.serve_engine import bench_executor, engine_over
from bench.serve_host_costs import fingerprints_ms, sampled_rows_ms, stream_burst_ms
from bench.serve_host_standins import DeviceClock, StandInGraphs
from bench.serve_streams import StreamLoop
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.page_store import PendingFingerprints
from k3core.model import K3Model
from k3core.presets import preset
from services.engine import decode_overlap, sampler
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.decode_inputs import DecodeInputBuilder
from services.engine.engine import Engine
from services.engine.heap import freeze_startup_heap
from services.engine.model_runner import ModelRunner

STAGES = ("schedule", "build", "launch", "executor", "sample", "accept", "emit", "other", "step", "idle", "to_launch")


class StageTimer:
    """Wraps callables so that each call adds its wall time to a stage of the current step; "idle" adds the
    time from a step's tokens reaching the host (`tokens_ready`) to the next replay (`replayed`)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self._tokens_at: float | None = None

    def tokens_ready(self) -> None:
        self._tokens_at = time.perf_counter()

    def launching(self) -> None:
        if self._tokens_at is not None:
            self.current["to_launch"] += time.perf_counter() - self._tokens_at

    def replayed(self) -> None:
        if self._tokens_at is not None:
            self.current["idle"] += time.perf_counter() - self._tokens_at
            self._tokens_at = None

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[stage] += time.perf_counter() - began
        return timed


def build_engine(args: argparse.Namespace, batch: int, timer: StageTimer, streams: StreamLoop,
                 clock: DeviceClock | None = None) -> Engine:
    config = preset(args.model)
    with torch.device("meta"):
        model = K3Model(config)
    layout = plan_layout(shape_from_config(config, args.model), 1, state_dtype=torch.float32,
                         conv_dtype=torch.bfloat16, mla_dtype=torch.bfloat16, hash_block_tokens=args.hash_block)
    pages = batch * (layout.num_kda_groups + layout.num_mla_groups * (2 + args.context // layout.tokens_per_block))
    manager = PrefixCacheManager(layout, pages + 64, device="meta")
    # Meta pages have no bytes: a restore check or write-back reads zeros, and a commit's checksum is queued as
    # on a device (its launches are timed) but hands zeros over (a meta tensor cannot reach the host).
    store, queue_checksum = manager.store, manager.store.fingerprints_later
    store.fingerprints = lambda pages, num_bytes: [0] * len(pages)
    store.fingerprints_later = lambda pages, num_bytes: (queue_checksum(pages, num_bytes), PendingFingerprints(
        torch.zeros(len(pages), 2, dtype=torch.int64)))[1]
    runner = ModelRunner(model, "cpu", max_model_len=args.max_model_len, max_batch=max(args.batches))
    executor = bench_executor(manager, runner)
    # the executor takes the fast path on CUDA only (or with K3_DECODE_FASTPATH=1): here it is given one
    fast = executor.fastpath = executor.fastpath or DecodeFastPath(model, manager, max_model_len=args.max_model_len,
                                                                   max_batch=max(args.batches))
    def replayed() -> None:
        timer.replayed()
        if clock is not None:
            clock.replayed()
    fast.graphs = StandInGraphs(fast.builder, tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, batch})),
                                args.vocab, replayed)
    fast.draw_in_graph = False  # the stand-in replay runs no forward, so no argmax in it: the draw's is timed
    engine = engine_over(executor, batch, 8192, args.model, "bench_host")
    fill(engine, manager, batch, args.context, streams)
    if args.freeze_heap:
        freeze_startup_heap()  # as `Engine.start` does after a worker's warm-up
    # the stages: each wrapper adds its own time; "executor" is `execute` less the build and launch inside it
    for name in ("prepare", "compact"):
        setattr(fast.builder, name, timer.wrap("build", getattr(fast.builder, name)))
    launch = timer.wrap("launch", fast.launch)

    def marked_launch(*args):
        timer.launching()
        return launch(*args)
    fast.launch = marked_launch
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    execute = timer.wrap("executor", executor.execute)

    def execute_less_forward(plan):
        inner = timer.current["build"] + timer.current["launch"]
        try:
            return execute(plan)
        finally:
            timer.current["executor"] -= timer.current["build"] + timer.current["launch"] - inner
    executor.execute = execute_less_forward
    engine._take = timer.wrap("accept", engine._take)
    engine._take_rows = timer.wrap("accept", engine._take_rows)
    engine._flush = timer.wrap("emit", engine._flush)
    return engine


def fill(engine: Engine, manager: PrefixCacheManager, batch: int, context: int, streams: StreamLoop) -> None:
    """B running requests at `context` computed tokens plus one pending token, without a forward."""
    for i in range(batch):
        rid = f"host-{i}"
        prompt = [(7919 * i + 31 * j) % 997 + 1 for j in range(context)]
        hit = manager.add_request(rid, prompt)
        manager.reserve(rid, context - hit)
        streams.running(engine, rid, prompt, [i % 997 + 1])
    manager.pre_forward()
    for i in range(batch):
        manager.forward_done(f"host-{i}")
        manager.append_tokens(f"host-{i}", engine.requests[f"host-{i}"].output)
    manager.commit_step()


def run_steps(engine: Engine, timer: StageTimer, count: int, clock: DeviceClock | None = None
              ) -> list[tuple[float, dict[str, float]]]:
    """(seconds, seconds per wrapped call) of each of `count` engine steps."""
    steps = []
    for _ in range(count):
        timer.current = defaultdict(float)
        began = time.perf_counter()
        engine._step()
        if clock is not None:
            timer.current["gpu_idle"], clock.idle = clock.idle, 0.0
            timer.current["wake"], clock.late = clock.late, 0.0
        steps.append((time.perf_counter() - began, timer.current))
    return steps


def measure(args: argparse.Namespace, batch: int) -> dict:
    timer, streams = StageTimer(), StreamLoop()
    clock = DeviceClock(args.replay_ms / 1e3) if args.replay_ms else None
    engine = build_engine(args, batch, timer, streams, clock)
    rows: dict[str, list[float]] = defaultdict(list)
    draw, result = sampler.sample_rows_async, sampler.SampledTokens.array

    def tokens(handle: sampler.SampledTokens) -> np.ndarray:
        if clock is not None:
            clock.wait()  # the device's draw: not host time
        out = timer.wrap("sample", result)(handle)
        timer.tokens_ready()
        return out
    sampler.sample_rows_async = decode_overlap.sample_rows_async = timer.wrap("sample", draw)
    sampler.SampledTokens.array = tokens  # type: ignore[method-assign]
    try:
        steps = run_steps(engine, timer, args.warmup + args.steps, clock)
        engine.overlap.settle()  # the last step's tokens
        prepare = prepare_alone_ms(engine)
    finally:
        sampler.sample_rows_async = decode_overlap.sample_rows_async = draw
        sampler.SampledTokens.array = result  # type: ignore[method-assign]
        engine.executor.close()
        streams.close()
    for total, t in steps[args.warmup:]:
        staged = {stage: t[stage] for stage in STAGES if stage not in ("other", "step", "idle", "to_launch")}
        staged.update(other=total - sum(staged.values()), step=total, idle=t["idle"], to_launch=t["to_launch"])
        if clock is not None:
            staged["gpu_idle"], staged["wake"] = t["gpu_idle"], t["wake"]
        for stage, seconds in staged.items():
            rows[stage].append(1e3 * seconds)
    assert all(len(r.output) == 1 + args.warmup + args.steps for r in engine.scheduler.running)
    return {"batch": batch, "context": args.context, "overlap": engine.overlap.enabled, "prepare_alone": prepare,
            **{stage: {"p50_ms": float(np.percentile(rows[stage], 50)), "p99_ms": float(np.percentile(rows[stage], 99)),
                       "mean_ms": float(np.mean(rows[stage]))}
               for stage in rows}, **({"replay_ms": args.replay_ms} if clock is not None else {})}


def prepare_alone_ms(engine: Engine, reps: int = 200) -> dict:
    """`DecodeInputBuilder.prepare` of the running batch alone, with no other thread taking the GIL from it (in
    the steps the streams' loop often runs inside its numpy calls, and "build" counts that)."""
    fast, manager = engine.executor.fastpath, engine.executor.manager
    cached = [manager.requests[req.rid] for req in engine.scheduler.running]
    image, size = fast.staging(len(cached))
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        DecodeInputBuilder.prepare(fast.builder, cached, size, out=image)  # the class's: the instance's is timed
        times.append(1e3 * (time.perf_counter() - began))
    return {"p50_ms": float(np.percentile(times, 50))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=32768, help="sets the page-table width")
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=64, help="columns of the stand-in logits")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--replay-ms", type=float, default=0.0,
                        help="emulate a device whose replay takes this long (DeviceClock): adds gpu_idle")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-freeze-heap", dest="freeze_heap", action="store_false",
                        help="leave the GC as it is (the code before `heap.freeze_startup_heap`)")
    parser.add_argument("--no-sampled", dest="sampled", action="store_false", help="skip the sampled-rows timing")
    parser.add_argument("--fingerprint-pages", type=int, default=768, help="pages fingerprinted (0: skip); "
                        "768 = 64 rows x 12 KDA groups of mini")
    parser.add_argument("--fingerprint-bytes", type=int, default=16384, help="bytes per page (mini: 1 MiB)")
    parser.add_argument("--label", default="after", help="this run's key in the JSON (before / after)")
    parser.add_argument("--out", default="bench/results/serve_host.json")
    parser.add_argument("--peer", default="before", help="the JSON key of the run the ratios compare against")
    args = parser.parse_args()
    assert args.warmup + args.steps < args.hash_block, "no hash-block crossing: checkpoints need page bytes"
    torch.set_num_threads(1)
    path = Path(args.out)
    result = json.loads(path.read_text()) if path.exists() else {}
    before = {r["batch"]: r for r in result.get(args.peer, {}).get("rows", [])}
    run = {"model": args.model, "context": args.context, "vocab_standin": args.vocab, "steps": args.steps,
           "machine": f"{os.cpu_count()} CPU cores (shared), torch {torch.__version__}",
           "forward": "StandInGraphs: a stand-in replay (no-op) and static logits", "rows": []}
    print(f"host ms per decode step, {args.model}, context {args.context}, forward = STAND-IN (host time only)")
    columns = STAGES + (("gpu_idle",) if args.replay_ms else ())
    print(f"{'batch':>5} " + " ".join(f"{s + ' p50/p99':>18}" for s in columns) + f" {'step vs before':>14}")
    for batch in args.batches:
        row = measure(args, batch)
        run["rows"].append(row)
        peer = before.get(batch)
        ratio = f"{peer['step']['p50_ms'] / row['step']['p50_ms']:>13.2f}x" if peer and args.label != args.peer else ""
        print(f"{batch:>5} " + " ".join(f"{row[s]['p50_ms']:>8.3f}/{row[s]['p99_ms']:<9.3f}" for s in columns)
              + f" {ratio:>14}", flush=True)
        print(f"      prepare alone (no other thread): {row['prepare_alone']['p50_ms']:.3f} ms p50", flush=True)
        if args.replay_ms:
            print(f"      device idle per step (emulated {args.replay_ms} ms replay): p50 {row['gpu_idle']['p50_ms']:.3f} / mean "
                  f"{row['gpu_idle']['mean_ms']:.3f} ms (waking the engine thread: {row['wake']['mean_ms']:.3f}),"
                  f" step mean {row['step']['mean_ms']:.3f} ms", flush=True)
    run["stream_burst"] = burst = [stream_burst_ms(batch) for batch in args.batches]
    for row in burst:
        print(f"hand-over of {row['readers']} outputs on the streams' loop: OutputQueue {row['output_queue_ms']:.3f} ms, "
              f"asyncio.Queue {row['asyncio_queue_ms']:.3f} ms ({row['asyncio_queue_ms'] / row['output_queue_ms']:.2f}x)")
    vocab = preset(args.model).vocab_size
    for key, batch, reps in (("sampled_row", 1, 20), ("sampled_rows_64", 64, 5)) if args.sampled else ():
        run[key] = sampled_rows_ms(vocab, batch, reps)
        peer = result.get(args.peer, {}).get(key)
        ratio = f", {peer['p50_ms'] / run[key]['p50_ms']:.2f}x of {args.peer}" if peer and args.label != args.peer else ""
        print(f"{batch} sampled row(s) (temperature 0.7, {vocab} columns, `sample_rows` on this CPU): "
              f"{run[key]['p50_ms']:.2f} ms p50{ratio}")
    if args.fingerprint_pages:
        run["fingerprints"] = fp = fingerprints_ms(args.fingerprint_pages, args.fingerprint_bytes)
        print(f"fingerprints of {fp['pages']} pages x {fp['page_bytes']} B (a hash-boundary commit): row-batched "
              f"{fp['row_batched_ms']:.2f} ms, per page {fp['per_page_ms']:.2f} ms "
              f"({fp['per_page_ms'] / fp['row_batched_ms']:.2f}x)")
    result[args.label] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
