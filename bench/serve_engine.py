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
host see one token.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.serve_rank import Rank, sync
from bench.serve_streams import StreamLoop
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


class StepClock:
    """Per step: from the moment the previous step's tokens are on the host (the device has nothing left to
    run) to the end of this step's launched forward ("fwd"), and the critical path around it split in four
    (`critical_path`): CUDA events on a GPU (one clock for host and device: an event recorded while the GPU
    idles fires about when the host records it), wall time on the CPU."""

    def __init__(self, steps: int = 0) -> None:
        self.cuda = torch.cuda.is_available()
        self._ready: object | None = None
        self._prelaunch: object | None = None
        self._host_ready = self._host_launch = 0.0
        # per launched step: [tokens ready, before the launch call, after the forward, after its draw's copy]
        self.steps: list[list[object]] = []
        self.launch_host_s: list[float] = []  # host seconds inside the launch call
        self.waited_s: list[float] = []  # host seconds blocked on the tokens (~0: the host came late)
        self.host_to_launch_s: list[float] = []  # host clock: tokens read -> the launch call
        self.modes: list[str] = []  # per entry of `steps`: how the engine launched it (`PipelineMetrics.MODES`)
        self._unlabelled = False  # the last launch made an entry of `steps` that has no mode yet
        # the engine's `PipelineMetrics.counts` differences over the timed steps (`engine_decode`)
        self.pipeline: dict[str, dict[str, int]] = {}
        # events made ahead (4 a step): creating one on the critical path would add to what is measured
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4 * steps)] if self.cuda else []

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def waited(self, seconds: float) -> None:
        self.waited_s.append(seconds)

    def _elapsed(self, start: object, end: object) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start  # type: ignore[union-attr,operator]

    def tokens_ready(self) -> None:
        self._ready = self._mark()
        self._host_ready = time.perf_counter()

    def launching(self) -> None:
        self._prelaunch = self._mark()
        self._host_launch = time.perf_counter()
        if self._ready is not None:
            self.host_to_launch_s.append(self._host_launch - self._host_ready)

    def launched(self) -> None:
        if self._ready is not None and self._prelaunch is not None:
            self.launch_host_s.append(time.perf_counter() - self._host_launch)
            self.steps.append([self._ready, self._prelaunch, self._mark()])
            self.modes.append("?")
            self._unlabelled = True
        else:
            self._unlabelled = False
        self._ready = self._prelaunch = None

    def mode(self, name: str) -> None:
        """The engine counted its last launch as a step of this mode (right after the launch)."""
        if self._unlabelled:
            self.modes[-1] = name
            self._unlabelled = False

    def sampled(self) -> None:
        """After the draw of the last launched step was queued (its tokens' copy to the host included)."""
        if self.steps and len(self.steps[-1]) == 3:
            self.steps[-1].append(self._mark())

    def clear(self) -> None:
        for kept in (self.steps, self.launch_host_s, self.waited_s, self.host_to_launch_s, self.modes):
            kept.clear()
        self._unlabelled = False

    def median_seconds(self) -> float:
        sync()
        times = sorted(self._elapsed(ready, end) for ready, _, end, *_ in self.steps)
        return times[len(times) // 2] if times else float("nan")

    def critical_path(self, replay_s: float) -> dict:
        """Median microseconds of each part of the device's idle path between two forwards (consecutive
        launched steps): the draw (its kernels and the tokens' copy, after the forward), the host's wake-up
        (from the copy to the tokens read on the host), the host's work to the launch, and the launch (from
        the launch call to the forward's end, less one graph replay); the launch call's own host time; the
        device-clock cycle's median and mean (a mean above the median: outlier steps); on the host clock, the
        tokens-to-launch Python and how long the host waited for the tokens (the host was early by that); the
        steps by mode and the fallbacks by stage and reason (`pipeline`), and the slowest device-clock cycles
        with their steps' modes (`slowest_cycles`: where a mean above the median comes from)."""
        sync()
        parts: dict[str, list[float]] = {"draw": [], "wake": [], "to_launch": [], "launch": [], "cycle": []}
        cycles: list[tuple[float, int, str]] = []
        for k, (before, this) in enumerate(zip(self.steps, self.steps[1:], strict=False), start=1):
            if len(before) < 4:
                continue
            ready, prelaunch, end = this[:3]
            parts["draw"].append(self._elapsed(before[2], before[3]))
            parts["wake"].append(self._elapsed(before[3], ready))
            parts["to_launch"].append(self._elapsed(ready, prelaunch))
            parts["launch"].append(self._elapsed(prelaunch, end) - (0.0 if math.isnan(replay_s) else replay_s))
            parts["cycle"].append(self._elapsed(before[2], end))
            cycles.append((parts["cycle"][-1], k, self.modes[k]))
        out: dict = {f"{name}_us": 1e6 * statistics.median(v) for name, v in parts.items() if v}
        if parts["cycle"]:
            out["cycle_mean_us"] = 1e6 * statistics.fmean(parts["cycle"])
        host = {"launch_call": self.launch_host_s, "host_to_launch": self.host_to_launch_s, "waited": self.waited_s}
        out.update({f"{name}_us": 1e6 * statistics.median(v) for name, v in host.items() if v})
        out["pipeline"] = self.pipeline
        out["slowest_cycles"] = [{"step": k, "cycle_us": 1e6 * cycle, "mode": mode}
                                 for cycle, k, mode in sorted(cycles, reverse=True)[:SLOWEST]]
        return out


SLOWEST = 3  # the slowest cycles a row reports


def critical_path_line(path: dict) -> str:
    """The critical path's medians, then a line of the steps by mode, the fallbacks and the slowest cycles."""
    names = ("draw", "wake", "to_launch", "launch", "launch_call", "host_to_launch", "waited", "cycle", "cycle_mean")
    line = "  critical path (median us): " + ", ".join(f"{n} {path[n + '_us']:.1f}" for n in names
                                                         if n + "_us" in path)
    counts = path.get("pipeline", {})
    fallbacks = [f"{stage}/{reason} {n}" for stage in ("lookahead", "overlap")
                 for reason, n in counts.get(stage, {}).items()]
    slowest = [f"{c['cycle_us']:.0f} ({c['mode']}, step {c['step']})" for c in path.get("slowest_cycles", [])]
    return (f"{line}\n  steps by mode: {counts.get('steps', {})}; fallbacks: {', '.join(fallbacks) or 'none'}; "
            f"slowest cycles (us): {', '.join(slowest) or 'none'}")


class ModeTap:
    """A step-mode counter of `PipelineMetrics` that also tells the clock the mode of the step just launched."""

    def __init__(self, counter, mode: str, clock: StepClock) -> None:
        self.counter, self.mode, self.clock = counter, mode, clock

    def inc(self, amount: float = 1) -> None:
        self.counter.inc(amount)
        self.clock.mode(self.mode)


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


def engine_decode(rank: Rank, rids: list[str], context: int, steps: int) -> tuple[float, StepClock]:
    """(wall seconds per engine step, the steps' `StepClock`) of a request per rid at `context` tokens, left
    running in the pool (`Rank.finish`)."""
    prompts = rank.fill(rids, context)
    streams, clock = StreamLoop(), StepClock(steps + 8)
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
        run(engine._step, 3)  # captures this bucket's graph, then warm
        freeze_startup_heap()  # as `Engine.start` does after a worker's warm-up (no full GC pass mid-run)
        frozen = True
        clock.clear()
        counts = pipeline.counts()
        sync()
        started = time.perf_counter()
        with GcPauses() as pauses:
            run(engine._step, steps)
            engine.overlap.settle()  # the last step's tokens
            sync()
        wall = (time.perf_counter() - started) / steps
        clock.pipeline = counts_since(counts, pipeline.counts())
        print(f"  batch {len(rids)}: {pauses}", flush=True)
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
    assert all(len(engine.requests[r].output) == 4 + steps for r in rids), "a row missed a step"
    return wall, clock


def run(step: Callable[[], None], count: int) -> None:
    for _ in range(count):
        step()
