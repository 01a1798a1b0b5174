"""The admission controller of one replica: a scheduler per cluster, waiting callers, live budgets.

Budgets are per cluster: `default` from the config or the etcd document, overridden per cluster name.
Callers that must queue wait on a future the scheduler resolves when their class has room again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge

from services.admission.classifier import Classified, RequestClassifier
from services.admission.ledger import REQUEST_CLASSES, check_budgets
from services.admission.scheduler import AdmissionScheduler, Rejection, Released, Ticket, Waiter
from services.runtime import errors

log = logging.getLogger("k3.admission")
DECISIONS = Counter("k3_admission_decisions_total", "Admission outcomes", ["cluster", "request_class", "outcome"])
IN_USE = Gauge("k3_admission_in_use", "Cost units in flight", ["cluster", "request_class"])
BUDGET = Gauge("k3_admission_budget", "Cost units a class may hold", ["cluster", "request_class"])


class OverClassBudget(errors.ResourceExhausted):
    """The request alone costs more than its class's whole budget: waiting cannot help."""

    retriable = False


def parse_budget_document(raw: bytes | str) -> dict[str, dict[str, int]]:
    """{"default": {...}, "<cluster>": {...}} (or a flat {class: budget} meaning default)."""
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("budgets: the document must be a JSON object")
    if doc and all(k in REQUEST_CLASSES for k in doc):
        doc = {"default": doc}
    parsed = {}
    for cluster, budgets in doc.items():
        if not isinstance(budgets, dict):
            raise ValueError(f"budgets: entry {cluster!r} must map classes to budgets")
        parsed[cluster] = check_budgets(budgets)
    return parsed


class AdmissionController:
    def __init__(self, classifier: RequestClassifier, budgets: Mapping[str, int], max_queue: int,
                 ticket_ttl_s: float, instance: str, clock: Callable[[], float] = time.monotonic):
        self.classifier = classifier
        self.configured = {"default": check_budgets(budgets)}
        self.overrides: dict[str, dict[str, int]] = {}
        self.max_queue = max_queue
        self.ticket_ttl_s = ticket_ttl_s
        self.instance = instance
        self.clock = clock
        self.schedulers: dict[str, AdmissionScheduler] = {}
        self.waiters: dict[tuple[str, int], asyncio.Future[Ticket]] = {}

    def budgets_for(self, cluster: str) -> dict[str, int]:
        merged = dict(self.configured["default"])
        merged.update(self.overrides.get("default", {}))
        merged.update(self.overrides.get(cluster, {}))
        return merged

    def scheduler(self, cluster: str) -> AdmissionScheduler:
        if cluster not in self.schedulers:
            self.schedulers[cluster] = AdmissionScheduler(self.budgets_for(cluster), self.max_queue)
        return self.schedulers[cluster]

    async def admit(self, cluster: str, classified: Classified, timeout_s: float) -> Ticket:
        sched = self.scheduler(cluster)
        cls, now = classified.request_class, self.clock()
        if classified.cost > sched.ledger.account(cls).budget and classified.cost_class:
            # A failover re-prefill (or explicitly classed request) larger than its class's whole budget,
            # e.g. a 1M-token session, is budgeted by its size instead of being unadmittable.
            cls = classified.cost_class
        outcome = sched.offer(cls, classified.cost, now, now + timeout_s, classified.prefill_cost)
        if isinstance(outcome, Rejection):
            DECISIONS.labels(cluster, cls, "rejected").inc()
            error = errors.ResourceExhausted if outcome.retriable else OverClassBudget
            raise error(f"cluster {cluster}: {outcome.reason}", retry_after_ms=outcome.retry_after_ms)
        if isinstance(outcome, Ticket):
            return self._admitted(cluster, outcome)
        return await self._wait(cluster, sched, cls, outcome, timeout_s)

    async def _wait(self, cluster: str, sched: AdmissionScheduler, cls: str, waiter: Waiter,
                    timeout_s: float) -> Ticket:
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self.waiters[(cluster, waiter.key)] = future
        try:
            return self._admitted(cluster, await asyncio.wait_for(future, timeout_s))
        except TimeoutError:
            DECISIONS.labels(cluster, cls, "timed_out").inc()
            raise errors.ResourceExhausted(
                f"cluster {cluster}: {cls} class stayed over budget for the {timeout_s:.3g} s queue timeout",
                retry_after_ms=sched.retry_after_ms(cls, waiter.cost, self.clock())) from None
        finally:
            # Timed out or the caller went away: leave the queue (a no-op once admitted).
            self.waiters.pop((cluster, waiter.key), None)
            sched.cancel(cls, waiter.key)

    def _admitted(self, cluster: str, ticket: Ticket) -> Ticket:
        DECISIONS.labels(cluster, ticket.request_class, "admitted").inc()
        self._export(cluster)
        return ticket

    def ticket_id(self, cluster: str, ticket: Ticket) -> str:
        return f"{self.instance}/{cluster}/{ticket.ticket_id}"

    def release(self, ticket_id: str, prefill_only: bool = False) -> Released:
        _, cluster, local_id = ticket_id.rsplit("/", 2)
        sched = self.schedulers.get(cluster)
        if sched is None:
            return Released(False, 0, [])
        released = sched.release(local_id, self.clock(), prefill_only)
        self._deliver(cluster, released.admitted)
        self._export(cluster)
        return released

    def _deliver(self, cluster: str, admitted: list[tuple[Waiter, Ticket]]) -> None:
        for waiter, ticket in admitted:
            future = self.waiters.pop((cluster, waiter.key), None)
            if future is None or future.done():
                # Its caller gave up between the pump and now: give the cost straight back.
                self._deliver(cluster, self.schedulers[cluster].release(ticket.ticket_id, self.clock()).admitted)
            else:
                future.set_result(ticket)

    def apply_budget_document(self, raw: bytes | None) -> None:
        """Adopt budgets from etcd (None: the key was deleted, back to the config). Bad documents are
        logged and ignored, so a typo cannot zero every budget."""
        try:
            self.overrides = parse_budget_document(raw) if raw else {}
        except (ValueError, TypeError) as exc:
            log.error("ignoring invalid budget document", extra={"error": str(exc)})
            return
        log.info("budgets updated", extra={"overrides": self.overrides})
        now = self.clock()
        for cluster, sched in self.schedulers.items():
            self._deliver(cluster, sched.set_budgets(self.budgets_for(cluster), now))
            self._export(cluster)

    def sweep_expired_tickets(self) -> int:
        """Return the cost of tickets older than the TTL (their holder crashed without releasing)."""
        cutoff, swept = self.clock() - self.ticket_ttl_s, 0
        for cluster, sched in self.schedulers.items():
            for ticket in [t for t in sched.tickets.values() if t.admitted_at < cutoff]:
                self._deliver(cluster, sched.release(ticket.ticket_id, self.clock()).admitted)
                swept += 1
            self._export(cluster)
        return swept

    def _export(self, cluster: str) -> None:
        for cls, account in self.schedulers[cluster].ledger.accounts.items():
            IN_USE.labels(cluster, cls).set(account.in_use)
            BUDGET.labels(cluster, cls).set(account.budget)
