"""Run the Triton kernels through the CPU interpreter (CI has no GPU).

Triton decides at import time whether its own jitted helpers (tl.sigmoid, ...) are interpreted, so
TRITON_INTERPRET=1 must be set before triton is first imported in the process. This conftest sets it
when it is imported first; if something imported triton earlier without it, the Triton tests are skipped
with that reason (set TRITON_INTERPRET=1 in the environment to avoid it). The setting only concerns
Triton: kernels.dispatch never sends CPU tensors to Triton on its own.
"""

from __future__ import annotations

import os
import sys

import pytest

_TRITON_PREIMPORTED = "triton" in sys.modules
os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("numpy")  # the interpreter needs it; triton does not declare it
triton = pytest.importorskip("triton")


def _interpreter_ready() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(
        triton.language.standard.sigmoid, InterpretedFunction
    )


@pytest.fixture
def interpreted():
    """Triton kernels run interpreted on CPU tensors in this test."""
    if not _interpreter_ready():
        reason = "triton was imported before TRITON_INTERPRET=1" if _TRITON_PREIMPORTED else "no interpreter"
        pytest.skip(f"Triton interpreter unavailable: {reason}")


@pytest.fixture
def launch_grids(monkeypatch):
    """`launch_grids(module, kernel_name)` replaces that Triton kernel with a recorder that runs nothing and
    returns the list of the grids it is launched with (for tests of a launcher's planning)."""

    def record(module, name: str) -> list:
        grids: list = []

        class _Recorder:
            def __getitem__(self, grid):
                grids.append(grid)
                return lambda *args, **kwargs: None

        monkeypatch.setattr(module, name, _Recorder())
        return grids

    return record
