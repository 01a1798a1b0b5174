"""Worker processes shared by the worker tests (started once, in parallel)."""

from __future__ import annotations

import pytest

from tests.support.processes import ServiceProcess
from tests.workers.cluster import make, running, worker_args


@pytest.fixture(scope="package")
def transfer(tmp_path_factory):
    proc = ServiceProcess(["serve", "kvtransfer", "--port", "0", "--metrics-port", "-1"],
                          tmp_path_factory.mktemp("kvtransfer"))
    proc.start()
    yield proc
    proc.kill()


def _workers(tmp_path_factory, transfer, wanted):
    root = tmp_path_factory.mktemp("workers")
    yield from running({(role, tp): make(root, f"{role}{tp}", worker_args(role, tp, transfer.address))
                        for role, tp in wanted})


@pytest.fixture(scope="package")
def workers(tmp_path_factory, transfer):
    """prefill and decode at TP 1 and 2: {("prefill", 1): proc, ...} (7 processes)."""
    yield from _workers(tmp_path_factory, transfer, [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)])


@pytest.fixture(scope="package")
def workers_tp4(tmp_path_factory, transfer):
    """prefill at TP 4 and decode at TP 2 (7 processes)."""
    yield from _workers(tmp_path_factory, transfer, [("prefill", 4), ("decode", 2)])
