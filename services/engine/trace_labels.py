"""Named host ranges of the engine's hot path for `torch.profiler` (bench/serve_trace.py splits the decode
step's GPU idle by them). Off by default: a `record_function` costs ~6 us on this CPU even with no profiler
running, so `label` hands back one shared no-op context (~0.2 us) unless `tracing()` turned the labels on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.profiler import record_function

_OFF = contextlib.nullcontext()
_on = False


def label(name: str) -> contextlib.AbstractContextManager:
    """A `record_function(name)` range while tracing, else a no-op."""
    return record_function(name) if _on else _OFF


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """The labels on inside the block."""
    global _on
    _on = True
    try:
        yield
    finally:
        _on = False
