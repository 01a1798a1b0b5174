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


class Fallback:
    """Why a step did not run in the best pipelined mode the engine allows: the fixed label set of
    `k3_<role>_pipeline_fallbacks_total{stage, reason}`, chosen where the step's mode is decided (no label
    is built on the hot path: the children are made once, `PipelineMetrics`)."""

    BLOCK_CROSSING = "block_crossing"  # a row's next token starts a block (its page is reserved on the host)
    WAITING = "waiting"  # a request waits in the queue (the look-ahead cannot plan around an admission)
    ADMISSION = "admission"  # the scheduler admits a waiting request next step
    STOP_STRINGS = "stop_strings"  # only the host checks stop strings
    STOP_IDS = "stop_ids"  # more stop ids (with the EOS) than the look-ahead's device table holds
    LOGPROBS = "logprobs"
    FORCED = "forced_tokens"
    BUDGET = "budget"  # the batch is larger than the step's token budget
    BATCH_CHANGED = "batch_changed"  # the rows are not the running batch (a request left or was not scheduled)
    CANCEL = "cancel"  # a cancellation settles the step in flight
    CALL = "engine_call"  # a cross-thread `Engine.call` (a weight reload, a checkpoint read) runs between steps
    PREFILL = "prefill"  # the step computes prompt tokens (a new request, a prefill chunk)
    TRANSFER = "transfer"  # the step imports or exports a KV handle (or verifies drafts)
    MAX_PAGES = "max_pages"  # a crossing row's block table is full (the fast path's page limit)
    POOL = "pool"  # the pool cannot give the crossing rows their pages without preempting
    UNSUPPORTED = "unsupported"  # the decode fast path does not take these rows

    LOOKAHEAD = (BLOCK_CROSSING, WAITING, STOP_STRINGS, STOP_IDS, BUDGET, BATCH_CHANGED)
    OVERLAP = (ADMISSION, LOGPROBS, FORCED, BUDGET, BATCH_CHANGED, CANCEL, CALL, PREFILL, TRANSFER,
               MAX_PAGES, POOL, UNSUPPORTED)


class PipelineMetrics:
    """How decode steps ran: `{p}_steps_total{mode}` ("lookahead": launched before the previous step's
    tokens were in; "overlap": planned while it computed, launched once they were; "plain": a forward through
    the scheduler, every prefill and mixed step included) and `{p}_pipeline_fallbacks_total{stage, reason}`
    (stage "lookahead": a step that ran in the overlap instead of ahead; "overlap": a step that ran plain
    after a decode step, where the overlap is on). One counter increment a step; the children are resolved
    here once, so every label is exported (at 0) from the start."""

    MODES = ("lookahead", "overlap", "plain")

    def __init__(self, prefix: str) -> None:
        self.steps = Counter(f"{prefix}_steps", "Engine steps by how they were launched", ["mode"])
        self.fallbacks = Counter(f"{prefix}_pipeline_fallbacks", "Steps that did not run in the pipelined mode "
                                 "of their stage (lookahead, overlap), by reason", ["stage", "reason"])
        self.lookahead, self.overlap, self.plain = (self.steps.labels(mode) for mode in self.MODES)
        self.not_ahead = {reason: self.fallbacks.labels("lookahead", reason) for reason in Fallback.LOOKAHEAD}
        self.not_overlapped = {reason: self.fallbacks.labels("overlap", reason) for reason in Fallback.OVERLAP}

    def counts(self) -> dict[str, dict[str, float]]:
        """{"steps": {mode: n}, "lookahead": {reason: n}, "overlap": {reason: n}}: the counters' values now
        (for a bench row's or a test's difference of two readings)."""
        out: dict[str, dict[str, float]] = {"steps": {}, "lookahead": {}, "overlap": {}}
        for sample in self.steps.collect()[0].samples:
            if sample.name.endswith("_total"):
                out["steps"][sample.labels["mode"]] = sample.value
        for sample in self.fallbacks.collect()[0].samples:
            if sample.name.endswith("_total"):
                out[sample.labels["stage"]][sample.labels["reason"]] = sample.value
        return out


def counts_since(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """The non-zero differences of two `PipelineMetrics.counts` readings."""
    return {group: {key: int(value - before[group].get(key, 0.0)) for key, value in values.items()
                    if value != before[group].get(key, 0.0)} for group, values in after.items()}


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
        self.pipeline = PipelineMetrics(p)
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
