"""Fixtures for the sandbox manager: a real `k3 serve sandbox` process (gRPC + REST) running real sandboxes.

Everything here needs root (mounts, cgroups, namespaces) and the host tools installed by
.ci/install-sandbox-deps.sh. At the end, the fixtures check that nothing leaked: no mount under the
manager's root, no sandbox cgroup, no sandbox process.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from bench.sandbox_workload import BUMP, COUNTER_PY
from k3.v1 import sandbox_pb2 as pb
from k3.v1 import sandbox_pb2_grpc
from services.sandbox.backends import criu, namespace
from services.sandbox.backends.registry import unavailable_reason
from tests.support.processes import ServiceProcess

NS_UNAVAILABLE = None if os.geteuid() == 0 else "needs root (mounts, cgroups, namespaces)"
NS_UNAVAILABLE = NS_UNAVAILABLE or unavailable_reason("namespace")
CRIU_UNAVAILABLE = NS_UNAVAILABLE or unavailable_reason("criu")
requires_namespace = pytest.mark.skipif(bool(NS_UNAVAILABLE), reason=f"namespace backend: {NS_UNAVAILABLE}")
requires_criu = pytest.mark.skipif(bool(CRIU_UNAVAILABLE), reason=f"CRIU backend: {CRIU_UNAVAILABLE}")
# Each backend's parent cgroup (under every controller) holds one child cgroup per sandbox.
CGROUP_GROUP = {"namespace": namespace.CGROUP_GROUP, "criu": criu.CGROUP_GROUP}


def leaked_mounts(root: Path) -> list[str]:
    return [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(root) in line]


def leaked_cgroups(sandbox_ids: set[str]) -> list[str]:
    found = []
    for group in CGROUP_GROUP.values():
        for controller in Path("/sys/fs/cgroup").iterdir():
            found += [str(p) for p in (controller / group).glob("*") if p.is_dir() and p.name in sandbox_ids]
    return found


class Client:
    """Thin helpers over the generated stub so tests read as the scenario they check."""

    def __init__(self, stub: sandbox_pb2_grpc.SandboxServiceStub) -> None:
        self.stub = stub
        self.created: set[str] = set()

    def create(self, backend: str = "namespace", tenant: str = "t-test", **kw) -> pb.SandboxInfo:
        limits = pb.ResourceLimits(**kw.pop("limits", {}))
        info = self.stub.CreateSandbox(pb.CreateSandboxRequest(backend=backend, tenant=tenant, limits=limits,
                                                               **kw)).sandbox
        self.created.add(info.sandbox_id)
        return info

    def track(self, infos) -> list[pb.SandboxInfo]:
        infos = list(infos)
        self.created.update(i.sandbox_id for i in infos)
        return infos

    def run(self, sandbox_id: str, argv: list[str], timeout_s: int = 30, **kw) -> tuple[int, str, str]:
        out, err, code = b"", b"", None
        for msg in self.stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, argv=argv, timeout_s=timeout_s, **kw)):
            out += msg.stdout
            err += msg.stderr
            if msg.exited:
                code = msg.exit_code
        return code, out.decode(errors="replace"), err.decode(errors="replace")

    def sh(self, sandbox_id: str, script: str, timeout_s: int = 30) -> tuple[int, str, str]:
        return self.run(sandbox_id, ["sh", "-c", script], timeout_s)

    def start_counter(self, sandbox_id: str) -> None:
        self.stub.WriteFile(pb.WriteFileRequest(sandbox_id=sandbox_id, path="/home/user/counter.py",
                                                data=COUNTER_PY))
        self.run(sandbox_id, ["python3", "/home/user/counter.py"], background=True)
        code, _, err = self.sh(sandbox_id, "for i in $(seq 200); do [ -S /tmp/counter.sock ] && exit 0; "
                                           "sleep 0.05; done; exit 1")
        assert code == 0, f"counter did not start: {err}"

    def bump(self, sandbox_id: str) -> int:
        code, out, err = self.run(sandbox_id, BUMP)
        assert code == 0, err
        return int(out)

    def read(self, sandbox_id: str, path: str) -> str:
        return self.stub.ReadFile(pb.ReadFileRequest(sandbox_id=sandbox_id, path=path)).data.decode()

    def destroy(self, sandbox_id: str) -> None:
        self.stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id))


@pytest.fixture(scope="session")
def sandbox_service(tmp_path_factory):
    if NS_UNAVAILABLE:
        pytest.skip(f"sandbox service: {NS_UNAVAILABLE}")
    work = tmp_path_factory.mktemp("sandbox-service")
    root = work / "root"
    proc = ServiceProcess(["serve", "sandbox", "--port", "0", "--metrics-port", "0", "--rest-port", "0",
                           "--root-dir", str(root), "--max-sandboxes-per-tenant", "40",
                           "--housekeeping-interval-s", "0.2"], work)
    proc.start()
    channel = grpc.insecure_channel(proc.address)
    client = Client(sandbox_pb2_grpc.SandboxServiceStub(channel))
    yield proc, client
    channel.close()
    proc.signal(signal.SIGTERM)  # drain: the manager destroys every sandbox it still holds
    assert proc.wait(60) == 0, proc.log()[-3000:]
    assert leaked_mounts(root) == []
    assert leaked_cgroups(client.created) == []
    parents = [p for group in CGROUP_GROUP.values() for p in Path("/sys/fs/cgroup").glob(f"*/{group}")]
    assert parents == []  # the backends' parent cgroups are gone too
    stray = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True).stdout.split()
    assert stray == [], f"processes left behind: {stray}"


@pytest.fixture(scope="session")
def client(sandbox_service) -> Client:
    return sandbox_service[1]


@pytest.fixture(scope="session")
def rest_address(sandbox_service) -> str:
    return sandbox_service[0].info["rest_address"]
