"""Rollout auto-throttle (K3 report §5.3.1): how many rollout requests to keep in flight, from the engine's
running and waiting counts and KV-cache usage, so early rollouts saturate the engine and late, long ones do
not drive it into preemption. Additive increase while there is headroom, multiplicative decrease under
pressure."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineSignals:
    running: int
    waiting: int
    kv_usage: float  # fraction of the pool in use, 0..1


@dataclasses.dataclass
class AutoThrottle:
    min_concurrency: int = 1
    max_concurrency: int = 1024
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    increase: int = 8
    decrease: float = 0.7
    concurrency: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        self.concurrency = min(max(self.concurrency, self.min_concurrency), self.max_concurrency)

    def update(self, s: EngineSignals) -> int:
        # Queued work means the engine is already saturated: admitting more only adds preemption risk.
        if s.kv_usage >= self.high_watermark or s.waiting > max(1, s.running // 4):
            target = int(self.concurrency * self.decrease)
        elif s.kv_usage < self.low_watermark and s.waiting == 0:
            target = self.concurrency + self.increase
        else:
            target = self.concurrency
        self.concurrency = min(max(target, self.min_concurrency), self.max_concurrency)
        return self.concurrency
