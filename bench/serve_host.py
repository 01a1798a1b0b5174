"""Host time of one engine decode step (the GPU idles through it), on this CPU, per stage.

    python -m bench.serve_host [--model mini] [--batches 1 16 64 256] [--context 1024] [--steps 60]
                               [--label after] [--out bench/results/serve_host.json]

Drives the real engine step (`Engine._step`: scheduler, executor, the decode fast path's host side through
`DecodeGraphs.run`, batched sampling, output processing, the cache manager's calls) on B requests at
`context` tokens. Only the forward is replaced, by `StandInGraphs`: a STAND-IN for the captured CUDA graph
whose replay does nothing and whose logits are a static tensor, so what is timed is host work only. The
real forward cannot run here; the model and the page store live on the meta device (shapes and page ids
are the preset's, no bytes; the store's fingerprint is stubbed for the setup's checkpoint). The stand-in
logits are bf16 (the graph's dtype) with `--vocab` columns (default 64, not the preset's 163840): on a GPU
the cast and argmax over them are device work, which on this CPU would be timed as host work (at 1024
columns and batch 256 the CPU's bf16 argmax alone takes ~1 ms). Greedy rows, no tokenizer (the mini
preset's vocabulary has none here).

Stages (ms per step, p50 and p99 over `--steps` timed steps after warm-up):
- schedule: `Scheduler.schedule` (the cache manager's reserve calls, the plan)
- build: `DecodeInputBuilder.build` (the step's int64 input image)
- launch: the rest of `DecodeGraphs.run` (staging copy, stand-in replay) and the fast path's return
- executor: the rest of `Executor.execute` (manager pre_forward / forward_done / commit_step, logit rows)
- sample: `sample_rows` (one argmax and one host copy for the greedy rows)
- accept: the rest of `Engine._after_step` (output processing, metrics, append_tokens; the hand-over to
  the streams too where the engine makes it there, as it did before `Engine._flush`)
- emit: `Engine._flush`, the hand-over of the previous step's outputs to their streams after the launch
- step: the whole `Engine._step`; "other" is what none of the above covers (gauges, the step histogram)
- idle: step minus executor and emit: the host time a GPU waits through (those two run after the launch,
  while the graph computes; everything else is between one step's sync and the next launch)
Each request streams into a real `RequestStream` on an event loop thread (the service's hand-over: one
call_soon_threadsafe per output), drained by a task per request as the servicer does (without gRPC).
The peer each stage is compared against is the same stage of the `--peer` run in the JSON (default
`before`). Then `sample_rows` alone on 1 and 64 temperature > 0 rows over the preset's full vocabulary
(`sampled_row`, `sampled_rows_64`): device work on a GPU, host CPU here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from k3.v1 import common_pb2
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.model import K3Model
from k3core.presets import preset
from services.engine import engine as engine_module
from services.engine.cuda_graphs import DecodeGraphs, _Captured
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.decode_inputs import DecodeInputBuilder
from services.engine.engine import Engine
from services.engine.executor import Executor
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.output import OutputProcessor
from services.engine.params import GenerationOptions
from services.engine.plan import RecordingManager
from services.engine.request import EngineRequest, Phase
from services.engine.scheduler import Scheduler
from services.engine.streams import RequestStream
from services.kvtransfer.transfer_thread import TransferThread

STAGES = ("schedule", "build", "launch", "executor", "sample", "accept", "emit", "other", "step", "idle")


class _NoEvent:
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _NoGraph:
    def replay(self) -> None: ...


class StandInGraphs(DecodeGraphs):
    """STAND-IN for the CUDA graphs: `DecodeGraphs.run` itself runs (fill the staging buffer, copy it to the
    input buffer, replay), but the replay is a no-op and the logits a static [bucket, vocab] bf16 tensor."""

    def __init__(self, builder: DecodeInputBuilder, buckets: tuple[int, ...], vocab: int) -> None:
        self.builder, self.buckets, self.vocab, self._graphs = builder, buckets, vocab, {}
        self.device = torch.device("cpu")

    def _get(self, size: int) -> _Captured:
        if size not in self._graphs:
            host = torch.empty(self.builder.numel(size), dtype=torch.int64)
            logits = torch.randn(size, self.vocab, generator=torch.Generator().manual_seed(size)).bfloat16()
            self._graphs[size] = _Captured(_NoGraph(), torch.empty_like(host), host, _NoEvent(), logits)  # type: ignore[arg-type]
        return self._graphs[size]


class StageTimer:
    """Wraps callables so that each call adds its wall time to a stage of the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[stage] += time.perf_counter() - began
        return timed


def build_engine(args: argparse.Namespace, batch: int, timer: StageTimer, streams: StreamLoop) -> Engine:
    config = preset(args.model)
    with torch.device("meta"):
        model = K3Model(config)
    layout = plan_layout(shape_from_config(config, args.model), 1, state_dtype=torch.float32,
                         conv_dtype=torch.bfloat16, mla_dtype=torch.bfloat16, hash_block_tokens=args.hash_block)
    pages = batch * (layout.num_kda_groups + layout.num_mla_groups * (2 + args.context // layout.tokens_per_block))
    manager = PrefixCacheManager(layout, pages + 64, device="meta")
    manager.store.fingerprint = lambda page, num_bytes: 0  # meta pages have no bytes to hash (setup only)
    runner = ModelRunner(model, "cpu", max_model_len=args.max_model_len, max_batch=max(args.batches))
    executor = Executor(manager, runner, rank=0, tp_size=1, total_heads=config.kda_num_heads,
                        instance=common_pb2.InstanceId(service="bench"))
    # the executor takes the fast path on CUDA only (or with K3_DECODE_FASTPATH=1): here it is given one
    fast = executor.fastpath = executor.fastpath or DecodeFastPath(model, manager, max_model_len=args.max_model_len,
                                                                   max_batch=max(args.batches))
    fast.graphs = StandInGraphs(fast.builder, tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, batch})),
                                args.vocab)
    recording = RecordingManager(manager)
    scheduler = Scheduler(recording, hash_block_tokens=args.hash_block, max_running=batch,
                          step_token_budget=8192, model_name=args.model)
    engine = Engine(executor, scheduler, recording, OutputProcessor(None, config.eos_token_id),
                    EngineMetrics.for_role("bench_host"))
    fill(engine, manager, batch, args.context, streams)
    # the stages: each wrapper adds its own time; "launch"/"executor"/"accept" get their outer call's time
    # and lose the inner stages' afterwards (see `measure`)
    fast.builder.build = timer.wrap("build", fast.builder.build)
    fast.forward = timer.wrap("fastpath", fast.forward)
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    executor.execute = timer.wrap("execute", executor.execute)
    engine._after_step = timer.wrap("after_step", engine._after_step)
    engine._flush = timer.wrap("flush", engine._flush)
    return engine


class StreamLoop:
    """The server's event loop on its own thread: the requests' `RequestStream`s, each drained through its
    `outputs` iterator as the gRPC servicer does (undrained queues would grow, and the garbage collector's
    passes over them with it)."""

    def __init__(self) -> None:
        self.thread = TransferThread("bench-streams")
        self._run = self.thread.run
        self.tasks: list[asyncio.Task] = []

    def stream(self) -> RequestStream:
        async def make() -> RequestStream:
            return RequestStream()
        return self._run(make())

    def drain(self, stream: RequestStream, engine: Engine, req: EngineRequest) -> None:
        async def consume() -> None:
            async for _ in stream.outputs(engine, req):
                pass

        async def spawn() -> None:
            self.tasks.append(asyncio.get_running_loop().create_task(consume()))
        self._run(spawn())

    def close(self) -> None:
        async def finish() -> None:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self._run(finish())
        self.thread.close()


def fill(engine: Engine, manager: PrefixCacheManager, batch: int, context: int, streams: StreamLoop) -> None:
    """B running requests at `context` computed tokens plus one pending token, without a forward."""
    options = GenerationOptions(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_tokens=1 << 20, stop=(),
                                stop_token_ids=frozenset(), ignore_eos=True)
    for i in range(batch):
        rid = f"host-{i}"
        prompt = [(7919 * i + 31 * j) % 997 + 1 for j in range(context)]
        hit = manager.add_request(rid, prompt)
        manager.reserve(rid, context - hit)
        stream = streams.stream()
        req = EngineRequest(rid, prompt, options, emit=stream.emit, phase=Phase.RUNNING, output=[i % 997 + 1])
        streams.drain(stream, engine, req)
        req.first_token_at = req.last_token_at = time.monotonic()
        engine.requests[rid] = req
        engine.scheduler.running.append(req)
    manager.pre_forward()
    for i in range(batch):
        manager.forward_done(f"host-{i}")
        manager.append_tokens(f"host-{i}", engine.requests[f"host-{i}"].output)
    manager.commit_step()


def run_steps(engine: Engine, timer: StageTimer, count: int) -> list[tuple[float, dict[str, float]]]:
    """(seconds, seconds per wrapped call) of each of `count` engine steps."""
    steps = []
    for _ in range(count):
        timer.current = defaultdict(float)
        began = time.perf_counter()
        engine._step()
        steps.append((time.perf_counter() - began, timer.current))
    return steps


def measure(args: argparse.Namespace, batch: int) -> dict:
    timer, streams = StageTimer(), StreamLoop()
    engine = build_engine(args, batch, timer, streams)
    rows: dict[str, list[float]] = defaultdict(list)
    sample_rows = engine_module.sample_rows
    engine_module.sample_rows = timer.wrap("sample", sample_rows)  # the engine loop's batched draw
    try:
        steps = run_steps(engine, timer, args.warmup + args.steps)
    finally:
        engine_module.sample_rows = sample_rows
        engine.executor.close()
        streams.close()
    for total, t in steps[args.warmup:]:
        staged = {"schedule": t["schedule"], "build": t["build"], "launch": t["fastpath"] - t["build"],
                  "executor": t["execute"] - t["fastpath"], "sample": t["sample"],
                  "accept": t["after_step"] - t["sample"]}
        staged["emit"] = t["flush"]
        staged["other"] = total - t["schedule"] - t["execute"] - t["after_step"] - t["flush"]
        staged["step"] = total
        staged["idle"] = total - staged["executor"] - staged["emit"]
        for stage, seconds in staged.items():
            rows[stage].append(1e3 * seconds)
    assert all(len(r.output) == 1 + args.warmup + args.steps for r in engine.scheduler.running)
    return {"batch": batch, "context": args.context,
            **{stage: {"p50_ms": float(np.percentile(rows[stage], 50)), "p99_ms": float(np.percentile(rows[stage], 99))}
               for stage in STAGES}}


def sampled_rows_ms(vocab: int, batch: int, reps: int = 20) -> dict:
    """Host ms of `sample_rows` for `batch` temperature > 0 rows (each its own seed) over the full vocabulary
    on this CPU: on a GPU these rows are device work, here every column's draw is host CPU."""
    rows = [(row, GenerationOptions(temperature=0.7, top_k=0, top_p=1.0, seed=1 + row, max_tokens=8, stop=(),
                                    stop_token_ids=frozenset(), ignore_eos=True), 0) for row in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for index in range(reps):
        began = time.perf_counter()
        engine_module.sample_rows(logits, [(row, options, index) for row, options, _ in rows])
        times.append(1e3 * (time.perf_counter() - began))
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=32768, help="sets the page-table width")
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=64, help="columns of the stand-in logits")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
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
    print(f"{'batch':>5} " + " ".join(f"{s + ' p50/p99':>18}" for s in STAGES) + f" {'step vs before':>14}")
    for batch in args.batches:
        row = measure(args, batch)
        run["rows"].append(row)
        peer = before.get(batch)
        ratio = f"{peer['step']['p50_ms'] / row['step']['p50_ms']:>13.2f}x" if peer and args.label != args.peer else ""
        print(f"{batch:>5} " + " ".join(f"{row[s]['p50_ms']:>8.3f}/{row[s]['p99_ms']:<9.3f}" for s in STAGES)
              + f" {ratio:>14}", flush=True)
    vocab = preset(args.model).vocab_size
    for key, batch, reps in (("sampled_row", 1, 20), ("sampled_rows_64", 64, 5)):
        run[key] = sampled_rows_ms(vocab, batch, reps)
        peer = result.get(args.peer, {}).get(key)
        ratio = f", {peer['p50_ms'] / run[key]['p50_ms']:.2f}x of {args.peer}" if peer and args.label != args.peer else ""
        print(f"{batch} sampled row(s) (temperature 0.7, {vocab} columns, `sample_rows` on this CPU): "
              f"{run[key]['p50_ms']:.2f} ms p50{ratio}")
    result[args.label] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
