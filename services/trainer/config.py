"""Trainer configuration (flags, K3_TRAINER_* env vars, or a --config file)."""

from __future__ import annotations

import dataclasses

from services.runtime import ServiceConfig


@dataclasses.dataclass
class TrainerConfig(ServiceConfig):
    model: str = "nano"
    seed: int = 0
    batch_size: int = 8
    lr: float = 2e-3
    tau: float = 0.1  # the loss's log-ratio penalty
    qk_clip_tau: float = 100.0  # cap on every Gated MLA head's max attention logit (K2's default)
    publish_dir: str = "/var/lib/k3/weights"

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.batch_size < 1:
            problems.append("batch_size: must be >= 1")
        if self.lr <= 0:
            problems.append("lr: must be > 0")
        if self.qk_clip_tau <= 0:
            problems.append("qk_clip_tau: must be > 0")
        return problems
