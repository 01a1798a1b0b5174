"""A decode row of bench/serve.py through the engine's own loop: `Engine._step` (scheduler, executor, the decode
fast path in its CUDA graphs, the host/device overlap of `decode_overlap`, batched sampling, output
processing, streaming into real `RequestStream`s) on the rank's pool, model and fast path.

The engine needs the service runtime's packages (grpcio, protobuf, prometheus-client; on the device from
`.device/wheels`, installed by bench/gpu_session.sh; without them bench/serve_decode.py times the rank's own
loop and says so). The one departure from a served
request: each row is fed a pseudo-random next token (`Rank.next_tokens`): the engine's draw runs on the
device and is waited for as always, then its values are replaced (the argmax of random weights is one token
for every row, which would route the whole batch to four experts). With the decode look-ahead (on by
default at TP 1; K3_DECODE_LOOKAHEAD=0 turns it off) a step reads its tokens on the device: there the draw's
device rows are the same feed, uploaded before the run (`SampledTokens.device_rows`), so the device and the
host see one token. Except with the draw in the graph (the default; K3_DECODE_DRAW_IN_GRAPH=0 turns it off): an
all-greedy draw is published by the graph itself, so the device reads the argmax (one token for every row) while
the host sees the feed; the rows ignore the EOS and have no stop ids, so nothing the device does depends on the
values but the MoE routing, which the dense experts' form (batch 64 on mini: 64 x top-k >= 2 x experts) does not
read (in rows whose experts follow the tokens the feed is published over the argmax: `publish_feed`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.serve_rank import Rank, sync
from bench.serve_streams import StreamLoop
from bench.step_clock import ModeTap, StepClock
from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from services.engine import decode_overlap, sampler
from services.engine.engine import Engine
from services.engine.executor import Executor
from services.engine.heap import freeze_startup_heap, release_startup_heap
from services.engine.metrics import EngineMetrics, counts_since
from services.engine.model_runner import ModelRunner
from services.engine.output import OutputProcessor
from services.engine.plan import RecordingManager
from services.engine.scheduler import Scheduler


class GcPauses:
    """Garbage-collector passes inside a `with` block, per generation, and the wall time they took: a
    step-time outlier with a long pass in its window is the collector's (a full pass once cost 0.2 s)."""

    def __init__(self) -> None:
        self.passes, self.seconds, self._began = [0, 0, 0], 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._began

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return f"gc passes by generation {self.passes}, {1e3 * self.seconds:.1f} ms in the timed window"


def allocations() -> tuple[int, float, int]:
    """So far in this process: pinned host blocks torch's host allocator made (`cudaHostAlloc` calls), their
    microseconds, and device segments its caching allocator made (`cudaMalloc` calls); zeros without CUDA or
    the statistics. A growth inside a timed window is host time on the step's critical path."""
    if not torch.cuda.is_available():
        return 0, 0.0, 0
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return (int(host.get("num_host_alloc", 0)), float(host.get("host_alloc_time.total", 0.0)),
            int(torch.cuda.memory_stats().get("num_device_alloc", 0)))


def build_engine(rank: Rank, batch: int) -> Engine:
    """An engine over the rank's manager, model and fast path (TP 1, greedy, no tokenizer)."""
    rank.runner.decode_fastpath = lambda manager, tp_size, speculative=False: rank.fast  # the executor takes the rank's fast path
    return engine_over(bench_executor(rank.manager, rank.runner), batch, max(8192, batch), "bench", "bench_serve")


def bench_executor(manager: PrefixCacheManager, runner: ModelRunner) -> Executor:
    """A TP-1 executor over `manager` and `runner` (its fast path: `runner.decode_fastpath`'s)."""
    return Executor(manager, runner, rank=0, tp_size=1, total_heads=runner.model.config.kda_num_heads,
                    instance=common_pb2.InstanceId(service="bench"))


def engine_over(executor: Executor, batch: int, step_token_budget: int, model_name: str, role: str) -> Engine:
    """The engine the benches drive (bench.serve_engine, bench.serve_host): `executor` (its fast path set
    before this: the overlap is decided at construction), up to `batch` running rows, no tokenizer."""
    recording = RecordingManager(executor.manager)
    scheduler = Scheduler(recording, hash_block_tokens=executor.manager.layout.hash_block_tokens, max_running=batch,
                          step_token_budget=step_token_budget, model_name=model_name)
    return Engine(executor, scheduler, recording, OutputProcessor(None, executor.runner.model.config.eos_token_id),
                  EngineMetrics.for_role(role))


def admit(engine: Engine, rank: Rank, rids: list[str], prompts: list[list[int]], streams: StreamLoop) -> None:
    """The rows as running requests with one pending token each (their prompts computed by `Rank.fill`)."""
    for row, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        req = streams.running(engine, rid, prompt, rank.next_tokens(len(rids), -1)[row:row + 1])
        rank.manager.append_tokens(rid, req.output)


def engine_decode(rank: Rank, rids: list[str], context: int, steps: int,
                  publish_feed: bool = False) -> tuple[float, StepClock]:
    """(wall seconds per engine step, the steps' `StepClock`) of a request per rid at `context` tokens, left
    running in the pool (`Rank.finish`). `publish_feed`: with the draw in the graph, each draw's feed is
    published over the graph's argmax (one copy a step, which a served step does not pay), so that the
    device reads the feed where what it reads follows the tokens (`serve_decode.routes_by_tokens`)."""
    prompts = rank.fill(rids, context)
    streams, clock = StreamLoop(), StepClock(steps + WARM_STEPS + SETTLE_STEPS + 8)
    engine = build_engine(rank, len(rids))
    admit(engine, rank, rids, prompts, streams)
    fed = [0]
    # every step's feed made ahead: on the device this runs between the tokens' arrival and the launch
    feeds = {(len(rids), k): rank.next_token_array(len(rids), k) for k in range(1, steps + 16)}
    on_device = {key: torch.from_numpy(feed).to(rank.fast.device) for key, feed in feeds.items()} \
        if rank.fast is not None and rank.fast.lookahead else {}
    result, rows, launch = sampler.SampledTokens.array, sampler.SampledTokens.device_rows, \
        rank.fast.launch if rank.fast is not None else None
    draw = decode_overlap.sample_rows_async

    def feed_number(handle: sampler.SampledTokens) -> int:
        """The feed of a draw: numbered in the order of the draws' first use (host or device)."""
        if not hasattr(handle, "feed_number"):
            fed[0] += 1
            handle.feed_number = fed[0]  # type: ignore[attr-defined]
        return handle.feed_number  # type: ignore[attr-defined]

    def fed_tokens(handle: sampler.SampledTokens) -> np.ndarray:
        waiting = time.perf_counter()
        drawn = result(handle)
        clock.waited(time.perf_counter() - waiting)
        clock.tokens_ready()
        number = feed_number(handle)
        feed = feeds.get((len(drawn), number))
        return rank.next_token_array(len(drawn), number) if feed is None else feed

    def fed_rows(handle: sampler.SampledTokens) -> torch.Tensor:
        drawn = rows(handle)
        number = feed_number(handle)
        feed = on_device.get((len(drawn), number))
        return torch.from_numpy(rank.next_token_array(len(drawn), number)).to(drawn.device) if feed is None else feed

    def timed_launch(*args) -> torch.Tensor:
        clock.launching()
        logits = launch(*args)  # type: ignore[misc]
        clock.launched()
        return logits

    def timed_draw(*args) -> sampler.SampledTokens:
        tokens = draw(*args)
        if publish_feed:
            rank.fast.publish(fed_rows(tokens))
        clock.sampled()
        return tokens

    pipeline = engine.metrics.pipeline
    counted = {mode: getattr(pipeline, mode) for mode in pipeline.MODES}
    for mode, child in counted.items():  # each step's mode, as the engine counts it right after its launch
        setattr(pipeline, mode, ModeTap(child, mode, clock))
    sampler.SampledTokens.array = fed_tokens  # type: ignore[method-assign]
    sampler.SampledTokens.device_rows = fed_rows  # type: ignore[method-assign]
    decode_overlap.sample_rows_async = timed_draw
    if rank.fast is not None:  # else the reference layers run (fwd stays NaN)
        rank.fast.launch = timed_launch  # type: ignore[method-assign]
    frozen = False
    try:
        run(engine._step, WARM_STEPS)  # captures this bucket's graph, then warm
        freezing = time.perf_counter()
        freeze_startup_heap()  # as `Engine.start` does after a worker's warm-up (no full GC pass mid-run)
        frozen, froze_s = True, time.perf_counter() - freezing
        # the freeze's full collection leaves the device idle; an engine freezes once, at start: the timed
        # steps begin after a few steps of the running pipeline, not right after that idle
        run(engine._step, SETTLE_STEPS)
        clock.clear()
        counts = pipeline.counts()
        sync()
        allocated = allocations()
        started = time.perf_counter()
        with GcPauses() as pauses:
            run(engine._step, steps)
            engine.overlap.settle()  # the last step's tokens
            sync()
        wall = (time.perf_counter() - started) / steps
        clock.pipeline = counts_since(counts, pipeline.counts())
        clock.allocations = [now - before for now, before in zip(allocations(), allocated, strict=True)]
        print(f"  batch {len(rids)}: {pauses}; allocated in it: {clock.allocations[0]} pinned host blocks "
              f"({clock.allocations[1]:.0f} us), {clock.allocations[2]} device segments; the heap freeze before "
              f"it took {1e3 * froze_s:.0f} ms", flush=True)
    finally:
        sampler.SampledTokens.array = result  # type: ignore[method-assign]
        sampler.SampledTokens.device_rows = rows  # type: ignore[method-assign]
        decode_overlap.sample_rows_async = draw
        for mode, child in counted.items():
            setattr(pipeline, mode, child)
        if rank.fast is not None:
            del rank.fast.launch
        streams.close()
        engine.executor.close()
        if frozen:  # as `Engine.stop` does: this row's engine must not outlive it
            release_startup_heap()
    assert all(len(engine.requests[r].output) == 1 + WARM_STEPS + SETTLE_STEPS + steps for r in rids), \
        "a row missed a step"
    return wall, clock


WARM_STEPS = 3  # before the heap freeze: the bucket's graph captured, then warm
SETTLE_STEPS = 2  # after it, untimed (session 8: a row's first timed cycle after the freeze took 3-10 ms)


def run(step: Callable[[], None], count: int) -> None:
    for _ in range(count):
        step()
