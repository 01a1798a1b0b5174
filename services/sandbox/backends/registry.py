"""The backends this build knows, which of them can run on this host, and why not when they cannot."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from services.sandbox.backends.base import SandboxBackend
from services.sandbox.backends.criu import CriuBackend
from services.sandbox.backends.firecracker import FirecrackerBackend
from services.sandbox.backends.namespace import NamespaceBackend

log = logging.getLogger("k3.sandbox")
BACKENDS: dict[str, type[SandboxBackend]] = {
    "namespace": NamespaceBackend,
    "criu": CriuBackend,
    "firecracker": FirecrackerBackend,
}


@functools.cache
def unavailable_reason(name: str) -> str | None:
    return BACKENDS[name].probe()


def available_backends(root_dir: Path) -> dict[str, SandboxBackend]:
    """One instance of every backend that can run here, each under its own directory of `root_dir`."""
    out = {}
    for name, cls in BACKENDS.items():
        reason = unavailable_reason(name)
        if reason:
            log.warning("sandbox backend unavailable", extra={"backend": name, "reason": reason})
            continue
        out[name] = cls(Path(root_dir) / name)
    return out
