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
    tau: float = 0.1
    publish_dir: str = "/var/lib/k3/weights"

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.batch_size < 1:
            problems.append("batch_size: must be >= 1")
        if self.lr <= 0:
            problems.append("lr: must be > 0")
        return problems
