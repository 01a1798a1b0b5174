"""Worker metrics, named k3_decode_* on the decode worker and k3_prefill_* on the prefill worker."""

from __future__ import annotations

import bisect
import time
from collections import deque

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from k3core.cache.metrics import CacheMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BatchedObservations:
    """Observations of one histogram gathered over an engine step and recorded together (`flush`): the
    same bucket counts and sum as one `Histogram.observe` per value, at ~0.3 us a value instead of 1.5 (a
    lock, a `_raise_if_not_observable` and a scan of the buckets each; the TPOT of every row of every
    decode step: 0.4 ms of the engine thread per step at batch 256). Uses the histogram's value cells
    (`_upper_bounds`, `_buckets`, `_sum`), checked against `observe` itself in tests/workers/test_serve_host.py."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._values: list[float] = []

    def add(self, value: float) -> None:
        self._values.append(value)

    def flush(self) -> None:
        values, self._values = self._values, []
        if not values:
            return
        histogram = self.histogram
        bounds = histogram._upper_bounds  # ascending, +Inf last: value v goes to the first bound >= v
        counts = [0] * len(bounds)
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        histogram._sum.inc(total)
        for bucket, count in zip(histogram._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class EngineMetrics:
    """One set per role and process (Prometheus names are process-global); `for_role` hands it out."""

    _by_role: dict[str, EngineMetrics] = {}

    @classmethod
    def for_role(cls, role: str) -> EngineMetrics:
        if role not in cls._by_role:
            cls._by_role[role] = cls(role)
        return cls._by_role[role]

    def __init__(self, role: str):
        p = f"k3_{role}"
        self.running = Gauge(f"{p}_running", "Requests in the running batch")
        self.waiting = Gauge(f"{p}_waiting", "Requests queued (new or preempted)")
        self.pool_usage = Gauge(f"{p}_pool_usage", "Fraction of pool pages referenced by requests")
        self.pool_cached = Gauge(f"{p}_pool_cached_fraction", "Fraction of pool pages held only by the cache")
        self.hit_rate = Gauge(f"{p}_prefix_hit_rate", "Prompt tokens served from the prefix cache / looked up")
        self.ttft = Histogram(f"{p}_ttft_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS)
        self.tpot = Histogram(f"{p}_tpot_seconds", "Time per output token after the first", buckets=LATENCY_BUCKETS)
        self.tpot_batch = BatchedObservations(self.tpot)  # the engine adds a step's values, flushed at hand-over
        self.tokens_per_second = Gauge(f"{p}_tokens_per_second", "Generated tokens per second (last 10 s)")
        self.generated = Counter(f"{p}_generated_tokens", "Tokens generated")
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens computed (not served from cache)")
        self.preemptions = Counter(f"{p}_preemptions", "Requests preempted because the pool was full")
        self.finished = Counter(f"{p}_requests_finished", "Requests ended", ["reason"])
        self.step_seconds = Histogram(f"{p}_step_seconds", "Engine step duration", buckets=LATENCY_BUCKETS)
        self.overlapped_steps = Counter(f"{p}_overlapped_steps", "Decode steps launched before the previous "
                                        "step's tokens were accepted (decode_overlap.py)")
        # Set once at start by services/engine/warmup.py (rank 0), before the worker turns SERVING.
        self.warmup_seconds = Gauge(f"{p}_warmup_seconds", "Duration of the worker's warm-up at start (0: skipped)",
                                    ["stage"])
        self.cache = CacheMetrics(REGISTRY, prefix=f"{p}_prefix_cache")
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0  # sum of the counts in _recent (summing the deque per call was O(calls in 10 s))
        self.current_tokens_per_second = 0.0

    def record_tokens(self, count: int) -> None:
        now = time.monotonic()
        self.generated.inc(count)
        self._recent.append((now, count))
        self._recent_tokens += count
        while self._recent and now - self._recent[0][0] > 10:
            self._recent_tokens -= self._recent.popleft()[1]
        span = max(now - self._recent[0][0], 1.0)
        self.current_tokens_per_second = self._recent_tokens / span
        self.tokens_per_second.set(self.current_tokens_per_second)
