"""The shared runtime, exercised through real processes on loopback and a real etcd."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli.health_cmd import check
from services.runtime.client import sync_channel
from services.runtime.errors import error_detail
from services.runtime.registry import Watcher
from tests.support.metrics import scrape

TICKER = "tests.runtime.ticker_service"


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def complete(address: str, max_tokens: int, token: str = "", timeout: float | None = None):
    with sync_channel(address, token) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.CompleteRequest(request_id="r1",
                                              sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        return [c.chunk.token_ids[0] for c in stub.Complete(request, timeout=timeout)]


def test_health_errors_and_metrics(spawn):
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "0", "--tick-s", "0.001")
    assert check(svc.address) == "SERVING"
    assert check(svc.address, "k3.v1.GatewayService") == "SERVING"
    assert complete(svc.address, 3) == [0, 1, 2]

    with pytest.raises(grpc.RpcError) as bad:
        complete(svc.address, 0)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_tokens" in bad.value.details()
    assert error_detail(bad.value).field == "sampling.max_tokens"

    with pytest.raises(grpc.RpcError) as busy:
        complete(svc.address, 20_000)
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_detail(busy.value).retry_after_ms == 250
    assert dict(busy.value.trailing_metadata())["retry-after-ms"] == "250"

    metrics = scrape(svc.info["metrics_address"])
    for code in ("INVALID_ARGUMENT", "OK"):
        labels = {"code": code, "method": "Complete", "service": "ticker"}
        assert metrics.value("k3_rpc_requests_total", labels) == 1


def test_deadline_is_honoured(spawn):
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "-1", "--tick-s", "0.2")
    with pytest.raises(grpc.RpcError) as late:
        complete(svc.address, 50, timeout=0.3)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_auth_token_required_except_health(spawn):
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "-1", "--tick-s", "0.001",
                env={"K3_AUTH_TOKEN": "s3cret"})
    assert check(svc.address) == "SERVING"
    with pytest.raises(grpc.RpcError) as denied:
        complete(svc.address, 1)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError):
        complete(svc.address, 1, token="wrong")
    assert complete(svc.address, 2, token="s3cret") == [0, 1]
    # The token rides on every call shape, client-streaming ones included (gRPC does not tell them apart on
    # the wire, so the unary ListModels and the server-streaming Complete take request streams here).
    with sync_channel(svc.address, "s3cret") as channel:
        list_models = channel.stream_unary("/k3.v1.GatewayService/ListModels",
                                           request_serializer=gateway_pb2.ListModelsRequest.SerializeToString,
                                           response_deserializer=gateway_pb2.ListModelsResponse.FromString)
        assert [m.id for m in list_models(iter([gateway_pb2.ListModelsRequest()]), timeout=5).models] == ["ticker"]
        stream = channel.stream_stream("/k3.v1.GatewayService/Complete",
                                       request_serializer=gateway_pb2.CompleteRequest.SerializeToString,
                                       response_deserializer=gateway_pb2.CompleteResponse.FromString)
        request = gateway_pb2.CompleteRequest(sampling=common_pb2.SamplingParams(max_tokens=2))
        assert [c.chunk.token_ids[0] for c in stream(iter([request]), timeout=5)] == [0, 1]


def test_bad_config_is_a_clear_error(spawn):
    with pytest.raises(RuntimeError) as exc:
        spawn("serve", TICKER, "--port", "notaport", "--lease-ttl-s", "0")
    assert "port: expected an integer, got 'notaport'" in str(exc.value)


def test_sigterm_during_stream_completes_then_exits_zero(spawn):
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "-1", "--tick-s", "0.05",
                "--drain-grace-s", "10")
    with sync_channel(svc.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stream = stub.Complete(gateway_pb2.CompleteRequest(sampling=common_pb2.SamplingParams(max_tokens=20)))
        first = next(stream)
        svc.signal(signal.SIGTERM)
        # Health says NOT_SERVING and new calls are refused while the old one finishes.
        health = health_pb2_grpc.HealthStub(channel)
        assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                          == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = [c.chunk.token_ids[0] for c in stream]
    assert [first.chunk.token_ids[0], *rest] == list(range(20))
    assert svc.wait(15) == 0


def test_sigterm_past_grace_cancels_cleanly(spawn):
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "-1", "--tick-s", "0.1",
                "--drain-grace-s", "0.3")
    with sync_channel(svc.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stream = stub.Complete(gateway_pb2.CompleteRequest(sampling=common_pb2.SamplingParams(max_tokens=500)))
        next(stream)
        svc.signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as cut:
            list(stream)
        assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert svc.wait(15) == 0


def test_registration_disappears_after_sigkill(spawn, etcd_server):
    ttl = 2
    common = ["--port", "0", "--metrics-port", "-1", "--etcd-endpoints", etcd_server,
              "--lease-ttl-s", str(ttl), "--cluster", "c1"]
    a = spawn("serve", TICKER, *common, "--instance", "a")
    b = spawn("serve", TICKER, *common, "--instance", "b")
    watcher = Watcher([etcd_server], "/k3")
    try:
        def instances():
            return {r.instance for r in watcher.snapshot().values() if r.cluster == "c1"}
        assert wait_until(lambda: instances() == {"a", "b"}, 10), instances()
        assert check(a.address) == check(b.address) == "SERVING"
        records = {r.instance: r for r in watcher.snapshot().values()}
        assert records["a"].address == a.address

        a.kill()
        killed_at = time.monotonic()
        assert wait_until(lambda: instances() == {"b"}, ttl + 1.0), instances()
        assert time.monotonic() - killed_at <= ttl + 1.0

        # A graceful stop revokes the lease at once.
        b.signal(signal.SIGTERM)
        assert wait_until(lambda: instances() == set(), 1.0)
        assert b.wait(10) == 0
    finally:
        watcher.close()


def test_etcd_outage_keeps_serving_and_reregisters(spawn, etcd_restartable):
    endpoint = etcd_restartable.endpoint
    svc = spawn("serve", TICKER, "--port", "0", "--metrics-port", "-1", "--etcd-endpoints", endpoint,
                "--lease-ttl-s", "2", "--instance", "x", "--tick-s", "0.001")
    watcher = Watcher([endpoint], "/k3")
    try:
        assert wait_until(lambda: len(watcher.snapshot()) == 1, 10)
        etcd_restartable.stop()
        time.sleep(1.0)
        # Membership is kept as last known; the service keeps serving.
        assert len(watcher.snapshot()) == 1 and not watcher.connected
        assert complete(svc.address, 2) == [0, 1]
        assert wait_until(lambda: "etcd registration lost" in svc.log(), 10)
        etcd_restartable.start()
        assert wait_until(lambda: watcher.connected and len(watcher.snapshot()) == 1, 15)
        assert wait_until(lambda: "registered in etcd" in svc.log().split("registration lost")[-1], 15)
    finally:
        watcher.close()
