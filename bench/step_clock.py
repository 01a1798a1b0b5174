"""A decode step's critical path as bench.serve's engine rows time it (`StepClock`): per launched step, from
its tokens on the host to its forward's end, and the device's idle path between two forwards in four parts;
`ModeTap` labels each step with the mode the engine counted for it, `critical_path_line` prints a row's."""

from __future__ import annotations

import math
import statistics
import time

import torch

from bench.serve_rank import sync


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
        # over the timed steps: pinned host blocks made, their microseconds, device segments (`engine_decode`)
        self.allocations: list[float] = [0, 0.0, 0]
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
        parts: dict[str, list[float]] = {name: [] for name in (*PARTS, "cycle")}
        cycles: list[tuple[float, int, str, dict[str, float]]] = []
        for k, (before, this) in enumerate(zip(self.steps, self.steps[1:], strict=False), start=1):
            if len(before) < 4:
                continue
            ready, prelaunch, end = this[:3]
            parts["draw"].append(self._elapsed(before[2], before[3]))
            parts["wake"].append(self._elapsed(before[3], ready))
            parts["to_launch"].append(self._elapsed(ready, prelaunch))
            parts["launch"].append(self._elapsed(prelaunch, end) - (0.0 if math.isnan(replay_s) else replay_s))
            parts["cycle"].append(self._elapsed(before[2], end))
            cycles.append((parts["cycle"][-1], k, self.modes[k], {n: parts[n][-1] for n in PARTS}))
        out: dict = {f"{name}_us": 1e6 * statistics.median(v) for name, v in parts.items() if v}
        if parts["cycle"]:
            out["cycle_mean_us"] = 1e6 * statistics.fmean(parts["cycle"])
        host = {"launch_call": self.launch_host_s, "host_to_launch": self.host_to_launch_s, "waited": self.waited_s}
        out.update({f"{name}_us": 1e6 * statistics.median(v) for name, v in host.items() if v})
        out["pipeline"] = self.pipeline
        out["pinned_allocs"], out["pinned_alloc_us"], out["device_allocs"] = self.allocations
        out["slowest_cycles"] = [{"step": k, "cycle_us": 1e6 * cycle, "mode": mode,
                                  "parts_us": {n: 1e6 * v for n, v in split.items()}}
                                 for cycle, k, mode, split in sorted(cycles, reverse=True)[:SLOWEST]]
        return out


SLOWEST = 3  # the slowest cycles a row reports, each with its parts (where a long one's time went)
PARTS = ("draw", "wake", "to_launch", "launch")


def critical_path_line(path: dict) -> str:
    """The critical path's medians, then a line of the steps by mode, the fallbacks and the slowest cycles."""
    names = (*PARTS, "launch_call", "host_to_launch", "waited", "cycle", "cycle_mean")
    line = "  critical path (median us): " + ", ".join(f"{n} {path[n + '_us']:.1f}" for n in names
                                                         if n + "_us" in path)
    counts = path.get("pipeline", {})
    fallbacks = [f"{stage}/{reason} {n}" for stage in ("lookahead", "overlap")
                 for reason, n in counts.get(stage, {}).items()]
    slowest = [f"{c['cycle_us']:.0f} ({c['mode']}, step {c['step']}: "
               + " ".join(f"{n} {v:.0f}" for n, v in c.get("parts_us", {}).items()) + ")"
               for c in path.get("slowest_cycles", [])]
    return (f"{line}\n  steps by mode: {counts.get('steps', {})}; fallbacks: {', '.join(fallbacks) or 'none'}; "
            f"slowest cycles (us): {', '.join(slowest) or 'none'}")


class ModeTap:
    """A step-mode counter of `PipelineMetrics` that also tells the clock the mode of the step just launched."""

    def __init__(self, counter, mode: str, clock: StepClock) -> None:
        self.counter, self.mode, self.clock = counter, mode, clock

    def inc(self, amount: float = 1) -> None:
        self.counter.inc(amount)
        self.clock.mode(self.mode)
