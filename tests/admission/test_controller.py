"""The replica-local controller in-process: waiting callers, callers that give up, ticket TTL, budget docs."""

from __future__ import annotations

import asyncio

import pytest

from services.admission.classifier import Classified, RequestClassifier
from services.admission.controller import AdmissionController, OverClassBudget, parse_budget_document
from services.admission.cost_model import CostModel
from services.runtime import errors


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(clock: Clock, **budgets: int) -> AdmissionController:
    classifier = RequestClassifier(CostModel.k3_h200())
    return AdmissionController(classifier, budgets or {"SHORT": 100, "LONG": 1000}, max_queue=8,
                               ticket_ttl_s=60, instance="me", clock=clock)


async def test_waiter_that_gives_up_leaves_the_queue_and_costs_nothing():
    c = controller(Clock())
    held = await c.admit("c0", Classified("SHORT", 80), 1.0)
    waiter = asyncio.create_task(c.admit("c0", Classified("SHORT", 50), 10.0))
    await asyncio.sleep(0.01)
    assert len(c.scheduler("c0").queues["SHORT"]) == 1
    waiter.cancel()  # the gRPC caller went away
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(c.scheduler("c0").queues["SHORT"]) == 0
    assert c.release(c.ticket_id("c0", held)).found
    assert c.scheduler("c0").ledger.accounts["SHORT"].in_use == 0


async def test_queue_timeout_is_resource_exhausted_with_a_hint():
    c = controller(Clock())
    await c.admit("c0", Classified("SHORT", 100), 1.0)
    with pytest.raises(errors.ResourceExhausted) as err:
        await c.admit("c0", Classified("SHORT", 1), 0.05)
    assert "queue timeout" in err.value.message and err.value.retry_after_ms > 0
    assert c.scheduler("c0").stats["SHORT"].rejected == 1


async def test_oversized_request_is_not_retriable():
    with pytest.raises(OverClassBudget) as err:
        await controller(Clock()).admit("c0", Classified("LONG", 1001), 1.0)
    assert not err.value.detail().retriable


async def test_unreleased_tickets_expire_after_the_ttl_and_admit_waiters():
    clock = Clock()
    c = controller(clock)
    await c.admit("c0", Classified("SHORT", 100), 1.0)
    waiter = asyncio.create_task(c.admit("c0", Classified("SHORT", 30), 120.0))
    await asyncio.sleep(0.01)
    clock.now = 59.0
    assert c.sweep_expired_tickets() == 0
    clock.now = 60.5
    assert c.sweep_expired_tickets() == 1
    ticket = await asyncio.wait_for(waiter, 1.0)
    assert ticket.cost == 30 and c.scheduler("c0").ledger.accounts["SHORT"].in_use == 30


async def test_budget_documents_apply_per_cluster_and_bad_ones_are_ignored():
    c = controller(Clock())
    for cluster in ("c0", "c1"):
        c.scheduler(cluster)  # both clusters have live schedulers when the document arrives
    c.apply_budget_document(b'{"default": {"SHORT": 7}, "c1": {"SHORT": 9, "LONG": 3}}')
    assert c.budgets_for("c0") == {"SHORT": 7, "LONG": 1000}
    assert c.scheduler("c1").ledger.accounts["LONG"].budget == 3
    c.apply_budget_document(b'{"c1": {"SHORT": "lots"}}')
    assert c.scheduler("c1").ledger.accounts["SHORT"].budget == 9
    c.apply_budget_document(None)
    assert c.scheduler("c1").ledger.accounts["SHORT"].budget == 100


def test_budget_document_forms():
    assert parse_budget_document('{"SHORT": 5}') == {"default": {"SHORT": 5}}
    with pytest.raises(ValueError, match="unknown request class"):
        parse_budget_document('{"c0": {"BULK": 5}}')
    with pytest.raises(ValueError, match="JSON object"):
        parse_budget_document("[1, 2]")


async def test_failover_larger_than_the_failover_budget_is_budgeted_by_its_size():
    classifier = RequestClassifier(CostModel.k3_h200())
    c = AdmissionController(classifier, {"SHORT": 10_000, "LONG": 6_000_000, "FAILOVER": 5_000}, 8, 60, "me",
                            Clock())
    small = await c.admit("c0", classifier.classify(2_048, 0, 16, failover=True), 1.0)
    big = await c.admit("c0", classifier.classify(1_000_000, 0, 16, failover=True), 1.0)
    assert (small.request_class, big.request_class) == ("FAILOVER", "LONG")
