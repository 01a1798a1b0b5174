"""Prometheus metrics of the sandbox manager."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Gauge, Histogram

from services.sandbox.record import Sandbox

OP_SECONDS = Histogram(
    "k3_sandbox_operation_seconds", "Latency of sandbox operations", ["op", "backend"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10),
)
SANDBOXES = Gauge("k3_sandbox_sandboxes", "Live sandboxes", ["backend", "state"])
SANDBOX_MEMORY = Gauge("k3_sandbox_memory_bytes", "Memory charged to live sandboxes", ["backend", "state"])


@dataclass
class Timer:
    ms: float = 0.0


@contextmanager
def timed(op: str, backend: str) -> Iterator[Timer]:
    timer = Timer()
    start = time.perf_counter()
    yield timer
    elapsed = time.perf_counter() - start
    timer.ms = elapsed * 1e3
    OP_SECONDS.labels(op, backend).observe(elapsed)


def observe_population(sandboxes: Iterable[Sandbox], backends: Iterable[str]) -> None:
    """Sets the gauges of every backend, so one whose last sandbox just went reads 0, not its old count."""
    counts: dict[tuple[str, str], int] = {}
    memory: dict[tuple[str, str], int] = {}
    for sb in sandboxes:
        key = (sb.backend.name, "paused" if sb.paused else "running")
        counts[key] = counts.get(key, 0) + 1
        memory[key] = memory.get(key, 0) + sb.backend.memory_bytes(sb.handle)
    for backend in backends:
        for state in ("running", "paused"):
            SANDBOXES.labels(backend, state).set(counts.get((backend, state), 0))
            SANDBOX_MEMORY.labels(backend, state).set(memory.get((backend, state), 0))
