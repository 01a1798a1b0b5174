"""Session router configuration (flags, K3_ROUTER_* env vars, or a --config file)."""

from __future__ import annotations

import dataclasses
import math

from services.router.membership import parse_requirements
from services.runtime import ServiceConfig


@dataclasses.dataclass
class RouterConfig(ServiceConfig):
    port: int = 50061
    # A cluster is healthy while each named data-plane service has at least this many live instances.
    required_instances: str = "decode:1"
    # Relative capacity per cluster for placement, e.g. {"c0": 2, "c1": 1}; unnamed clusters weigh 1.
    cluster_weights: dict = dataclasses.field(default_factory=dict)
    # A recovered primary takes its sessions' new turns back only after staying healthy this long
    # (0 = at once); this damps flapping clusters, each flap otherwise costing a re-prefill both ways.
    failback_hold_s: float = 0.0
    # How long a cluster whose instances all vanished stays in the fleet (unhealthy) before it is re-placed.
    forget_after_s: float = 600.0
    # Placement table size (2**slot_bits slots); see docs/control-plane.md for the trade-off.
    slot_bits: int = 20
    # Decode workers probed per decision (the session's first ones in rendezvous order) and their timeout.
    probe_fanout: int = 4
    probe_timeout_ms: int = 150
    hash_block_tokens: int = 512

    def validate(self) -> list[str]:
        problems = super().validate()
        try:
            parse_requirements(self.required_instances)
        except ValueError as exc:
            problems.append(str(exc))
        if not isinstance(self.cluster_weights, dict):
            problems.append("cluster_weights: must be a mapping of cluster name to weight")
        else:
            for name, weight in self.cluster_weights.items():
                if not isinstance(weight, int | float) or not (weight > 0 and math.isfinite(weight)):
                    problems.append(f"cluster_weights: weight of {name!r} must be a number > 0, got {weight!r}")
        if self.failback_hold_s < 0:
            problems.append(f"failback_hold_s: must be >= 0, got {self.failback_hold_s}")
        if self.forget_after_s < 0:
            problems.append(f"forget_after_s: must be >= 0, got {self.forget_after_s}")
        if not 8 <= self.slot_bits <= 24:
            problems.append(f"slot_bits: must be in [8, 24], got {self.slot_bits}")
        if self.probe_fanout < 1:
            problems.append(f"probe_fanout: must be >= 1, got {self.probe_fanout}")
        if self.probe_timeout_ms < 1:
            problems.append(f"probe_timeout_ms: must be >= 1, got {self.probe_timeout_ms}")
        if self.hash_block_tokens < 1:
            problems.append(f"hash_block_tokens: must be >= 1, got {self.hash_block_tokens}")
        return problems
