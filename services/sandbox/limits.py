"""Turns the limits a request asks for (0 = use the default) into checked per-sandbox limits."""

from __future__ import annotations

from dataclasses import dataclass

from services.sandbox.backends.base import Limits
from services.sandbox.config import SandboxConfig
from services.sandbox.errors import InvalidRequest

# Below these a sandbox cannot even start its init and a shell: reject rather than fail obscurely later.
_FLOORS = {"memory_bytes": 16 << 20, "cpu_millis": 10, "pids": 8, "disk_bytes": 1 << 20, "wall_clock_s": 1}


@dataclass
class LimitRequest:
    memory_bytes: int = 0
    cpu_millis: int = 0
    pids: int = 0
    disk_bytes: int = 0
    wall_clock_s: int = 0
    network: bool = False


def resolve_limits(req: LimitRequest, config: SandboxConfig) -> Limits:
    values = {}
    for name, floor in _FLOORS.items():
        asked = getattr(req, name)
        value = asked or getattr(config, f"default_{name}")
        ceiling = getattr(config, f"max_{name}")
        if not floor <= value <= ceiling:
            raise InvalidRequest(f"limits.{name}", f"must be in [{floor}, {ceiling}], got {asked}")
        values[name] = value
    if req.network and not config.allow_host_network:
        raise InvalidRequest("limits.network", "network access is disabled on this manager (it would share the "
                             "host's network; an operator can set allow_host_network)")
    return Limits(network=req.network, **values)
