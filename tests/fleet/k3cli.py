"""Run the `k3` operator CLI as a real subprocess against a local fleet whose state lives in K3_HOME."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from services.cli import fleet

REPO = Path(__file__).resolve().parents[2]


def k3(home: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], env=env, cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)


def state(home: Path) -> fleet.FleetState:
    with _home(home):
        loaded = fleet.FleetState.load()
    assert loaded is not None, f"no fleet state in {home}"
    return loaded


@contextlib.contextmanager
def running_fleet(home: Path, *up_args: str) -> Iterator[subprocess.CompletedProcess]:
    """`k3 up ARGS` ... `k3 down`; whatever survives `down` (a failed test) is killed for real."""
    started = k3(home, "up", *up_args)
    try:
        assert started.returncode == 0, f"k3 up failed:\n{started.stdout}\n{started.stderr}\n{logs(home)}"
        yield started
    finally:
        k3(home, "down", "--grace-s", "5")
        with _home(home):
            leftover = fleet.FleetState.load()
            if leftover is not None:
                fleet.terminate([m.pid for m in leftover.members] + [leftover.etcd_pid], 0)


def logs(home: Path, tail: int = 1500) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-tail:]}" for p in sorted((home / "logs").glob("*.log")))


@contextlib.contextmanager
def _home(home: Path) -> Iterator[None]:
    previous = os.environ.get("K3_HOME")
    os.environ["K3_HOME"] = str(home)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("K3_HOME")
        else:
            os.environ["K3_HOME"] = previous
