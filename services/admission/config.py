"""Admission controller configuration (flags, K3_ADMISSION_* env vars, or a --config file)."""

from __future__ import annotations

import dataclasses

from services.admission.cost_model import CostModel
from services.admission.ledger import check_budgets
from services.router.damping import MassLossSettings
from services.runtime import ServiceConfig

# In-flight cost (GPU-ms, see cost_model.py) each class may hold per cluster. Sized for a 16-node x 8-GPU
# cluster (bench/admission.py): SHORT far above its steady need at 100 req/s, LONG two 1M-token prefills,
# FAILOVER ~50 GPU-s of re-prefill in flight, which keeps survivors' short p99 TTFT flat during a surge.
# Operators override them per cluster, live, through etcd (docs/control-plane.md).
DEFAULT_BUDGETS = {"SHORT": 2_000_000, "MEDIUM": 1_000_000, "LONG": 11_200_000, "FAILOVER": 50_000,
                   "ROLLOUT": 500_000}


@dataclasses.dataclass
class AdmissionConfig(ServiceConfig, MassLossSettings):
    port: int = 50062
    # Per-cluster budgets by class; the etcd key below overrides them live.
    budgets: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    # Under etcd_prefix; JSON {"default": {class: budget}, "<cluster>": {class: budget}}.
    budgets_key: str = "/admission/budgets"
    # How long Admit waits in its class queue when the request names no timeout.
    queue_timeout_ms: int = 2_000
    max_queue: int = 1_024
    # Tickets never released (a crashed client) return their cost after this long.
    ticket_ttl_s: float = 3_600.0
    # Cost-model constants (CostModel field names); empty keeps the K3-on-H200 calibration.
    cost_model: dict = dataclasses.field(default_factory=dict)
    # Class edges in cost units; 0 keeps the defaults (8K-prompt and 128K-prompt requests).
    short_max_cost: float = 0.0
    medium_max_cost: float = 0.0
    def model(self) -> CostModel:
        return dataclasses.replace(CostModel.k3_h200(), **self.cost_model)

    def validate(self) -> list[str]:
        problems = super().validate()
        try:
            check_budgets(self.budgets)
        except ValueError as exc:
            problems.append(str(exc))
        known = {f.name for f in dataclasses.fields(CostModel)}
        if not isinstance(self.cost_model, dict) or set(self.cost_model) - known:
            problems.append(f"cost_model: keys must be among {sorted(known)}")
        elif any(not isinstance(v, int | float) or v < 0 for v in self.cost_model.values()):
            problems.append("cost_model: constants must be numbers >= 0")
        if self.queue_timeout_ms < 0:
            problems.append(f"queue_timeout_ms: must be >= 0, got {self.queue_timeout_ms}")
        if self.max_queue < 0:
            problems.append(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.ticket_ttl_s <= 0:
            problems.append(f"ticket_ttl_s: must be > 0, got {self.ticket_ttl_s}")
        if self.short_max_cost < 0 or self.medium_max_cost < 0:
            problems.append("short_max_cost/medium_max_cost: must be >= 0")
        problems += self.mass_loss_problems()
        return problems
