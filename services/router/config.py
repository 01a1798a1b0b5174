"""Session router configuration (flags, K3_ROUTER_* env vars, or a --config file)."""

from __future__ import annotations

import dataclasses
import math

from services.router.damping import MassLossSettings
from services.router.membership import parse_requirements
from services.runtime import ServiceConfig

PLACEMENT_MODES = ("stateless", "bounded")


@dataclasses.dataclass
class RouterConfig(ServiceConfig, MassLossSettings):
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
    # "stateless": (primary, backup) is a pure function of (session, fleet); "bounded": the backup is chosen
    # once per session under a per-(primary, backup) cap and stored in etcd (docs/control-plane.md: when).
    placement_mode: str = "stateless"
    # Bounded mode: each pair holds at most ceil((1 + eps) x its fair share) of its primary's sessions.
    bounded_eps: float = 0.1
    # Bounded mode: a session's stored assignment expires this long after its last route (up to one lease
    # window later). A window's assignments share one etcd lease, and an active session is re-leased at most
    # once per window: a longer window means fewer etcd writes and a looser expiry.
    session_idle_ttl_s: float = 3600.0
    assignment_lease_window_s: float = 300.0
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
        if self.placement_mode not in PLACEMENT_MODES:
            problems.append(f"placement_mode: must be one of {list(PLACEMENT_MODES)}, got {self.placement_mode!r}")
        if not 0 <= self.bounded_eps <= 10:
            problems.append(f"bounded_eps: must be in [0, 10], got {self.bounded_eps}")
        if self.session_idle_ttl_s < 1:
            problems.append(f"session_idle_ttl_s: must be >= 1, got {self.session_idle_ttl_s}")
        if not 0 < self.assignment_lease_window_s <= self.session_idle_ttl_s:
            problems.append("assignment_lease_window_s: must be > 0 and <= session_idle_ttl_s, got "
                            f"{self.assignment_lease_window_s}")
        problems += self.mass_loss_problems()
        return problems
