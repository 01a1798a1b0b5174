"""Two admission replicas as real processes over a real etcd: owner-per-cluster accounting, forwarding,
RESOURCE_EXHAUSTED with retry hints, queueing with deadlines, live budgets from etcd, clear bad-input errors.

The cost model is overridden to cost = uncached prompt tokens + output tokens, so every expected number is
hand-computed."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from k3.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from services.runtime.client import sync_channel
from services.runtime.errors import error_detail
from services.runtime.registry import connect
from tests.support.processes import ServiceProcess

# cost = uncached prompt tokens + output tokens.
LINEAR = {"prefill_ms_per_token": 1, "attention_ms_per_token_pair": 0, "decode_ms_per_step": 1,
          "decode_ms_per_context_token": 0}
BUDGETS = {"SHORT": 1000, "MEDIUM": 50_000, "LONG": 200_000, "FAILOVER": 300, "ROLLOUT": 100}
SHORT, LONG, FAILOVER = (common_pb2.REQUEST_CLASS_SHORT, common_pb2.REQUEST_CLASS_LONG,
                         common_pb2.REQUEST_CLASS_FAILOVER)


@pytest.fixture(scope="module")
def replicas(etcd_server, tmp_path_factory):
    prefix = f"/k3test-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("admission")
    procs = [ServiceProcess(["serve", "admission", "--port", "0", "--metrics-port", "-1", "--cluster", "global",
                             "--etcd-endpoints", etcd_server, "--etcd-prefix", prefix, "--lease-ttl-s", "2",
                             "--instance", f"adm-{i}", "--budgets", json.dumps(BUDGETS),
                             "--cost-model", json.dumps(LINEAR), "--short-max-cost", "1000",
                             "--medium-max-cost", "100000", "--queue-timeout-ms", "300"],
                            workdir / f"adm-{i}") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), procs))
        stubs = [admission_pb2_grpc.AdmissionServiceStub(sync_channel(p.address)) for p in procs]
        # Both replicas see both (ownership needs the full membership).
        deadline = time.monotonic() + 10
        while len({s.GetBudgets(admission_pb2.GetBudgetsRequest(cluster="c0")).owner for s in stubs}) != 1:
            assert time.monotonic() < deadline, "replicas never agreed on an owner"
            time.sleep(0.05)
        yield stubs, etcd_server, prefix
    finally:
        for p in procs:
            p.kill()


def admit(stub, cluster="c0", prompt=500, cached=0, out=0, **kw) -> admission_pb2.AdmitResponse:
    return stub.Admit(admission_pb2.AdmitRequest(cluster=cluster, prompt_tokens=prompt, cached_tokens=cached,
                                                 max_output_tokens=out, **kw), timeout=10)


def budgets(stub, cluster="c0") -> dict[int, admission_pb2.ClassBudget]:
    return {b.request_class: b for b in stub.GetBudgets(admission_pb2.GetBudgetsRequest(cluster=cluster)).budgets}


def release(stub, ticket: str) -> bool:
    return stub.ReleaseTicket(admission_pb2.ReleaseTicketRequest(ticket=ticket)).found


def test_any_replica_admits_and_releases_against_one_owner(replicas):
    (a, b), _, _ = replicas
    first = admit(a, prompt=600, cached=100)
    assert (first.request_class, first.cost) == (SHORT, 500)
    second = admit(b, prompt=300)
    assert budgets(a)[SHORT].in_use == budgets(b)[SHORT].in_use == 800
    # Released through the other replica: the ticket finds its way home.
    assert release(b, first.ticket) and release(a, second.ticket)
    assert not release(a, first.ticket)
    assert budgets(b)[SHORT].in_use == 0


def test_prefill_part_returns_at_the_first_token_and_the_rest_at_the_end(replicas):
    (a, b), _, _ = replicas
    admitted = admit(a, cluster="c5", prompt=700, cached=200, out=30)
    assert admitted.cost == 530
    early = b.ReleaseTicket(admission_pb2.ReleaseTicketRequest(ticket=admitted.ticket, prefill_done=True))
    assert early.found and early.returned_cost == 500
    assert budgets(a, "c5")[SHORT].in_use == 30
    again = a.ReleaseTicket(admission_pb2.ReleaseTicketRequest(ticket=admitted.ticket, prefill_done=True))
    assert again.found and again.returned_cost == 0
    final = a.ReleaseTicket(admission_pb2.ReleaseTicketRequest(ticket=admitted.ticket))
    assert final.found and final.returned_cost == 30 and budgets(b, "c5")[SHORT].in_use == 0


def test_over_budget_is_resource_exhausted_with_a_retry_hint_and_classes_are_independent(replicas):
    (a, b), _, _ = replicas
    held = admit(a, cluster="c1", prompt=900)
    with pytest.raises(grpc.RpcError) as err:
        admit(b, cluster="c1", prompt=200, queue_timeout_ms=1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = error_detail(err.value)
    assert detail.retriable and detail.retry_after_ms > 0 and "SHORT" in detail.message
    assert dict(err.value.trailing_metadata()).get("retry-after-ms")
    # SHORT is full, yet LONG and FAILOVER traffic are admitted from their own budgets.
    long = admit(b, cluster="c1", prompt=150_000)
    fail = admit(a, cluster="c1", prompt=250, failover=True)
    assert (long.request_class, fail.request_class) == (LONG, FAILOVER)
    snapshot = budgets(a, "c1")
    assert (snapshot[SHORT].in_use, snapshot[LONG].in_use, snapshot[FAILOVER].in_use) == (900, 150_000, 250)
    for t in (held, long, fail):
        release(a, t.ticket)


def test_queued_request_is_admitted_when_the_class_drains(replicas):
    (a, b), _, _ = replicas
    held = admit(a, cluster="c2", prompt=800)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(admit, b, cluster="c2", prompt=400, queue_timeout_ms=5_000)
        deadline = time.monotonic() + 5
        while budgets(a, "c2")[SHORT].queued != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        release(b, held.ticket)
        admitted = waiting.result(timeout=10)
    assert admitted.cost == 400 and admitted.queued_ms > 0
    release(a, admitted.ticket)


def test_a_request_larger_than_its_class_budget_is_not_retriable(replicas):
    (a, _), _, _ = replicas
    with pytest.raises(grpc.RpcError) as err:
        admit(a, cluster="c3", prompt=300_000)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not error_detail(err.value).retriable


def test_budgets_change_live_through_etcd(replicas):
    (a, b), etcd, prefix = replicas
    client = connect([etcd])
    try:
        held = admit(a, cluster="c4", prompt=1000)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(admit, b, cluster="c4", prompt=700, queue_timeout_ms=5_000)
            client.put(prefix + "/admission/budgets", json.dumps({"c4": {"SHORT": 2000}, "default": {"ROLLOUT": 7}}))
            # The raised budget admits the queued request without any release.
            assert waiting.result(timeout=10).cost == 700
        assert budgets(a, "c4")[SHORT].budget == 2000 and budgets(a, "c0")[SHORT].budget == 1000
        assert budgets(b, "c0")[common_pb2.REQUEST_CLASS_ROLLOUT].budget == 7
        # A malformed document is ignored, not applied.
        client.put(prefix + "/admission/budgets", json.dumps({"c4": {"SHORT": -5}}))
        client.put(prefix + "/admission/budgets", "{not json")
        time.sleep(0.3)
        assert budgets(a, "c4")[SHORT].budget == 2000
        client.delete(prefix + "/admission/budgets")
        deadline = time.monotonic() + 5
        while budgets(a, "c4")[SHORT].budget != 1000:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        release(a, held.ticket)
    finally:
        client.close()


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": 0}, "prompt_tokens"), ({"prompt": 10, "cached": 11}, "cached_tokens"),
    ({"cluster": ""}, "cluster"), ({"request_class": 42}, "request_class")])
def test_bad_requests_name_the_field(replicas, kwargs, field):
    (a, _), _, _ = replicas
    with pytest.raises(grpc.RpcError) as err:
        admit(a, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


def test_malformed_ticket_is_rejected(replicas):
    (a, _), _, _ = replicas
    with pytest.raises(grpc.RpcError) as err:
        release(a, "nonsense")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ticket" in err.value.details()
