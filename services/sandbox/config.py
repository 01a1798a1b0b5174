"""Sandbox manager configuration (flags, K3_SANDBOX_* env vars, or a --config file): defaults and ceilings
for limits, tenant quotas, housekeeping cadence."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime import ServiceConfig

MIB = 1 << 20
GIB = 1 << 30


@dataclass
class SandboxConfig(ServiceConfig):
    port: int = 50071
    root_dir: str = "/var/lib/k3/sandbox"
    default_backend: str = "namespace"
    rest_port: int = -1  # E2B-compatible REST facade; -1 disables it, 0 picks a free port
    # Defaults applied to limit fields a request leaves at 0, and the ceilings a request may not exceed.
    default_memory_bytes: int = 512 * MIB
    default_cpu_millis: int = 1000
    default_pids: int = 256
    default_disk_bytes: int = 512 * MIB
    default_wall_clock_s: int = 600
    max_memory_bytes: int = 16 * GIB
    max_cpu_millis: int = 8000
    max_pids: int = 4096
    max_disk_bytes: int = 16 * GIB
    max_wall_clock_s: int = 86400
    # Per-tenant quotas: live sandboxes and the sum of their memory limits.
    max_sandboxes_per_tenant: int = 200
    max_memory_per_tenant_bytes: int = 64 * GIB
    max_fork_count: int = 32
    # `limits.network=true` shares the host's network namespace (host loopback services included), so it is
    # refused unless an operator opts in; production would give each sandbox a veth behind NAT instead.
    allow_host_network: bool = False
    keep_periodic_snapshots: int = 3
    # Idle auto-pause also releases memory (checkpoint to disk) on backends that can; resume then restores.
    hibernate_when_idle: bool = True
    housekeeping_interval_s: float = 1.0

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.default_backend not in ("namespace", "criu", "firecracker"):
            problems.append(f"default_backend: must be namespace, criu or firecracker, got {self.default_backend!r}")
        for name in ("memory_bytes", "cpu_millis", "pids", "disk_bytes", "wall_clock_s"):
            default, ceiling = getattr(self, f"default_{name}"), getattr(self, f"max_{name}")
            if not 0 < default <= ceiling:
                problems.append(f"default_{name}: must be in (0, max_{name}={ceiling}], got {default}")
        if not -1 <= self.rest_port <= 65535:
            problems.append(f"rest_port: must be in [-1, 65535], got {self.rest_port}")
        if self.housekeeping_interval_s <= 0:
            problems.append(f"housekeeping_interval_s: must be > 0, got {self.housekeeping_interval_s}")
        return problems
