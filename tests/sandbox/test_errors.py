"""Bad requests get a clear gRPC status naming the problem, and lose nothing."""

from __future__ import annotations

import time

import grpc
import pytest

from k3.v1 import sandbox_pb2 as pb
from services.runtime.errors import error_detail
from tests.sandbox.conftest import requires_namespace
from tests.support.metrics import scrape

pytestmark = requires_namespace


def _fails(call, request, code: grpc.StatusCode, *needles: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call(request)
        if not hasattr(result, "ByteSize"):  # a server stream: the error arrives on iteration
            list(result)
    assert err.value.code() == code, err.value.details()
    for needle in needles:
        assert needle in err.value.details()
    return err.value


def test_unknown_sandbox_id(client):
    for call, request in [
        (client.stub.GetSandbox, pb.GetSandboxRequest(sandbox_id="sbx-nope")),
        (client.stub.PauseSandbox, pb.PauseSandboxRequest(sandbox_id="sbx-nope")),
        (client.stub.ForkSandbox, pb.ForkSandboxRequest(sandbox_id="sbx-nope", count=1)),
        (client.stub.Exec, pb.ExecRequest(sandbox_id="sbx-nope", argv=["true"])),
    ]:
        _fails(call, request, grpc.StatusCode.NOT_FOUND, "sbx-nope", "not found")
    err = _fails(client.stub.GetSandbox, pb.GetSandboxRequest(), grpc.StatusCode.INVALID_ARGUMENT, "sandbox_id")
    assert error_detail(err).field == "sandbox_id"


def test_exec_in_destroyed_sandbox_and_restore_of_deleted_snapshot(client):
    sid = client.create().sandbox_id
    client.sh(sid, "echo kept > /home/user/f")
    snap = client.stub.SnapshotSandbox(pb.SnapshotSandboxRequest(sandbox_id=sid)).snapshot_id
    client.destroy(sid)
    _fails(client.stub.Exec, pb.ExecRequest(sandbox_id=sid, argv=["true"]), grpc.StatusCode.NOT_FOUND,
           sid, "was destroyed")
    _fails(client.stub.DestroySandbox, pb.DestroySandboxRequest(sandbox_id=sid), grpc.StatusCode.NOT_FOUND)

    # The snapshot outlives its sandbox until deleted; after deletion it is gone for good.
    restored = client.track([client.stub.RestoreSandbox(pb.RestoreSandboxRequest(snapshot_id=snap)).sandbox])[0]
    assert client.read(restored.sandbox_id, "/home/user/f") == "kept\n"
    client.destroy(restored.sandbox_id)
    client.stub.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap))
    _fails(client.stub.RestoreSandbox, pb.RestoreSandboxRequest(snapshot_id=snap), grpc.StatusCode.NOT_FOUND,
           snap, "deleted")
    _fails(client.stub.DeleteSnapshot, pb.DeleteSnapshotRequest(snapshot_id=snap), grpc.StatusCode.NOT_FOUND)


def test_invalid_arguments_name_their_field(client):
    create = client.stub.CreateSandbox
    _fails(create, pb.CreateSandboxRequest(limits=pb.ResourceLimits(memory_bytes=1 << 50)),
           grpc.StatusCode.INVALID_ARGUMENT, "limits.memory_bytes")
    _fails(create, pb.CreateSandboxRequest(limits=pb.ResourceLimits(pids=2)), grpc.StatusCode.INVALID_ARGUMENT,
           "limits.pids")
    _fails(create, pb.CreateSandboxRequest(backend="vmware"), grpc.StatusCode.INVALID_ARGUMENT, "backend")
    _fails(create, pb.CreateSandboxRequest(limits=pb.ResourceLimits(network=True)),
           grpc.StatusCode.INVALID_ARGUMENT, "limits.network", "allow_host_network")
    _fails(create, pb.CreateSandboxRequest(image="no-such-image"), grpc.StatusCode.NOT_FOUND, "no-such-image")
    _fails(create, pb.CreateSandboxRequest(image="../etc"), grpc.StatusCode.INVALID_ARGUMENT, "image")
    sid = client.create().sandbox_id
    _fails(client.stub.Exec, pb.ExecRequest(sandbox_id=sid), grpc.StatusCode.INVALID_ARGUMENT, "argv")
    _fails(client.stub.ReadFile, pb.ReadFileRequest(sandbox_id=sid, path="etc/passwd"),
           grpc.StatusCode.INVALID_ARGUMENT, "path", "absolute")
    _fails(client.stub.ReadFile, pb.ReadFileRequest(sandbox_id=sid, path="/no/such/file"),
           grpc.StatusCode.INVALID_ARGUMENT, "path", "No such file")
    _fails(client.stub.ForkSandbox, pb.ForkSandboxRequest(sandbox_id=sid, count=10_000),
           grpc.StatusCode.INVALID_ARGUMENT, "count")
    _fails(client.stub.PauseSandbox, pb.PauseSandboxRequest(sandbox_id=sid, release_memory=True),
           grpc.StatusCode.FAILED_PRECONDITION, "namespace", "release memory")
    assert client.sh(sid, "echo fine")[1] == "fine\n"  # none of that hurt the sandbox
    client.destroy(sid)


def test_tenant_quota_is_resource_exhausted_with_retry_hint(client):
    # The service runs with max_sandboxes_per_tenant=40 and max_memory_per_tenant 64 GiB.
    _fails(client.stub.CreateSandbox, pb.CreateSandboxRequest(
        tenant="t-greedy", limits=pb.ResourceLimits(memory_bytes=17 << 30)), grpc.StatusCode.INVALID_ARGUMENT)
    ids = [client.create(tenant="t-greedy", limits={"memory_bytes": 15 << 30}).sandbox_id for _ in range(4)]
    err = _fails(client.stub.CreateSandbox, pb.CreateSandboxRequest(
        tenant="t-greedy", limits=pb.ResourceLimits(memory_bytes=15 << 30)), grpc.StatusCode.RESOURCE_EXHAUSTED,
        "t-greedy", "quota")
    assert error_detail(err).retry_after_ms > 0
    other = client.create(tenant="t-modest").sandbox_id  # another tenant is unaffected
    for sid in [*ids, other]:
        client.destroy(sid)


def test_list_backends_reports_capabilities_and_reasons(client):
    backends = {b.name: b for b in client.stub.ListBackends(pb.ListBackendsRequest()).backends}
    assert backends["namespace"].available and backends["namespace"].is_default
    assert not backends["namespace"].memory_snapshot and not backends["namespace"].live_fork
    assert backends["criu"].memory_snapshot and backends["criu"].live_fork
    # Full dumps only: CRIU pre-dumps need soft-dirty page tracking, which this kernel lacks.
    assert not backends["criu"].incremental and backends["firecracker"].incremental
    assert not backends["firecracker"].available and backends["firecracker"].reason


def test_operations_show_up_in_prometheus_metrics(client, sandbox_service):
    address = sandbox_service[0].info["metrics_address"]
    sid = client.create().sandbox_id
    client.stub.PauseSandbox(pb.PauseSandboxRequest(sandbox_id=sid))
    pauses = scrape(address).value("k3_sandbox_operation_seconds_count", {"backend": "namespace", "op": "pause"})
    assert pauses >= 1
    # The population gauges are refreshed by housekeeping (every 0.2 s in this service): wait for one pass.
    paused = {"backend": "namespace", "state": "paused"}
    deadline = time.monotonic() + 10
    while not scrape(address).get("k3_sandbox_sandboxes", paused):
        assert time.monotonic() < deadline, "the paused sandbox never showed up in k3_sandbox_sandboxes"
        time.sleep(0.1)
    assert scrape(address).value("k3_sandbox_memory_bytes", paused) > 0
    client.destroy(sid)
