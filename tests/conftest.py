"""Shared fixtures: a real etcd server on a free loopback port, and real service processes."""

from __future__ import annotations

import os

import pytest

# Many torch processes share 2 cores in these tests (the suite, service processes, fleets): one OpenMP
# thread each avoids spin-waiting threads starving each other. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CI has no GPU: Triton kernels run in its CPU interpreter, which Triton fixes at its first import (any
# test module importing services.engine pulls it in), so it is set here, before any of them.
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings

from services.runtime.local_etcd import EtcdServer
from tests.support.processes import ServiceProcess

# CI (.ci/test sets HYPOTHESIS_PROFILE=ci) replays the same examples on every run, so a landing is never
# decided by which random examples one run drew; local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A real etcd (the Debian etcd-server binary) for the whole test session; yields "127.0.0.1:PORT"."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server.endpoint
    server.stop()


@pytest.fixture
def etcd_restartable(tmp_path):
    """A private etcd a test may stop and restart (outage drills)."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def spawn(tmp_path):
    """Start services as real OS processes; all are killed at the end of the test."""
    started: list[ServiceProcess] = []

    def _spawn(*args: str, env: dict[str, str] | None = None, name: str = "svc") -> ServiceProcess:
        proc = ServiceProcess(list(args), tmp_path / f"{name}-{len(started)}", env=env)
        started.append(proc)
        proc.start()
        return proc

    yield _spawn
    for proc in started:
        proc.kill()
