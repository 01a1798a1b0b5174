"""Timing and roofline helpers for bench/kernels.py (GPU only).

Every kernel is timed the same way: CUDA-graph replay of `inner` back-to-back calls (so that the Python
launch cost of small kernels does not pose as GPU time), CUDA events around each replay, median over
`reps` replays after warm-up. Ceilings are measured in the same process: device-to-device copy bandwidth
(read + write bytes) and dense bf16 matmul throughput.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float
    bytes: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _events_ms(fn: Callable[[], object], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_ms(fn: Callable[[], object], inner: int = 20, reps: int = 30, warmup: int = 3,
            graph: bool = True) -> tuple[float, str]:
    """Median milliseconds of one call of `fn`, and the method used ('graph' or 'eager')."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(inner):
                    fn()
            g.replay()
            torch.cuda.synchronize()
            return statistics.median(_events_ms(g.replay, reps)) / inner, "graph"
        except Exception:  # noqa: BLE001 - some peers cannot be captured; fall back to eager launches
            torch.cuda.synchronize()
    eager = statistics.median(_events_ms(lambda: [fn() for _ in range(inner)], reps)) / inner
    return eager, "eager"


def kernel_ms(fn: Callable[[], object], calls: int = 1) -> dict[str, float | str]:
    """Device milliseconds per call of each GPU kernel `fn` launches (torch profiler over `calls` calls after
    one warm-up), to see where the time goes; {"profiler_error": ...} where profiling fails."""
    fn()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        return {e.key[:70]: round(getattr(e, "device_time_total", 0.0) / calls / 1e3, 5)
                for e in prof.key_averages() if getattr(e, "device_time_total", 0.0) > 0}
    except Exception as e:  # noqa: BLE001 - the breakdown is a diagnostic; the timing stands without it
        return {"profiler_error": repr(e)[:200]}


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy, counting read + write."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), inner=5, reps=20, graph=False)
    return 2 * n / (ms * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """bf16 dense matmul FLOP/s on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: a @ b, inner=5, reps=20, graph=False)
    return 2 * n**3 / (ms * 1e-3)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
