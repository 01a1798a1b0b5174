"""Admission decisions over a budget ledger: per-class FIFO queues with deadlines, tickets, retry hints.

Pure and clock-free (callers pass `now` in seconds), so the gRPC service and the discrete-event benchmark
run the same code. A class admits only while its own budget has room; when it has none, requests wait in
that class's FIFO queue until admitted or cancelled (its caller's deadline passed), so a burst of one class
queues behind itself only.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.admission.ledger import BudgetLedger

RATE_WINDOW_S = 30.0
MIN_RETRY_MS, MAX_RETRY_MS, UNKNOWN_RATE_RETRY_MS = 50, 60_000, 1_000


@dataclass(frozen=True)
class Ticket:
    ticket_id: str
    request_class: str
    cost: int
    arrived_at: float
    admitted_at: float
    # The part of `cost` that may be returned early, once the request's prefill is done (first token).
    prefill_cost: int = 0


@dataclass(frozen=True)
class Released:
    found: bool
    # Cost units given back to the class by this call.
    returned: int
    # Waiters of the same class admitted with the room this made.
    admitted: list[tuple[Waiter, Ticket]]


@dataclass(frozen=True)
class Rejection:
    reason: str
    retry_after_ms: int
    # False when waiting cannot help (the request alone is larger than its class budget).
    retriable: bool = True


@dataclass
class Waiter:
    key: int
    cost: int
    arrived_at: float
    prefill_cost: int = 0


@dataclass
class ClassStats:
    admitted: int = 0
    rejected: int = 0
    releases: deque[tuple[float, int]] = field(default_factory=deque)


class AdmissionScheduler:
    def __init__(self, budgets: Mapping[str, int], max_queue: int = 1024):
        self.ledger = BudgetLedger(budgets)
        self.max_queue = max_queue
        self.queues: dict[str, deque[Waiter]] = {cls: deque() for cls in self.ledger.accounts}
        self.stats: dict[str, ClassStats] = {cls: ClassStats() for cls in self.ledger.accounts}
        self.tickets: dict[str, Ticket] = {}
        # Cost each live ticket still holds (less than its cost once its prefill part was returned).
        self.held: dict[str, int] = {}
        self._keys = itertools.count(1)

    def offer(self, request_class: str, cost: int, now: float, deadline: float,
              prefill_cost: int = 0) -> Ticket | Waiter | Rejection:
        """Admit now, queue (a caller with `deadline` already past is not queued), or reject with a retry hint."""
        account = self.ledger.account(request_class)
        queue = self.queues[request_class]
        if cost > account.budget:
            self.stats[request_class].rejected += 1
            return Rejection(f"cost {cost} exceeds the whole {request_class} budget {account.budget}", 0, False)
        if not queue and self.ledger.fits(request_class, cost):
            return self._admit(request_class, Waiter(0, cost, now, prefill_cost), now)
        if deadline <= now or len(queue) >= self.max_queue:
            self.stats[request_class].rejected += 1
            why = "queue full" if len(queue) >= self.max_queue else "over budget"
            return Rejection(f"{request_class} class {why} ({account.in_use}/{account.budget} in use, "
                             f"{len(queue)} queued)", self.retry_after_ms(request_class, cost, now))
        waiter = Waiter(next(self._keys), cost, now, prefill_cost)
        queue.append(waiter)
        return waiter

    def release(self, ticket_id: str, now: float, prefill_only: bool = False) -> Released:
        """Return a ticket's cost (or, with prefill_only, just its prefill part, once); admits waiters of
        the same class with the room this makes. Partial and final releases add up to the admitted cost."""
        ticket = self.tickets.get(ticket_id)
        if ticket is None:
            return Released(False, 0, [])
        held = self.held[ticket_id]
        if prefill_only:
            returned = max(held - (ticket.cost - ticket.prefill_cost), 0)
            self.held[ticket_id] = held - returned
        else:
            returned = held
            del self.tickets[ticket_id], self.held[ticket_id]
        self.ledger.give_back(ticket.request_class, returned)
        releases = self.stats[ticket.request_class].releases
        releases.append((now, returned))
        while releases and releases[0][0] < now - RATE_WINDOW_S:
            releases.popleft()
        return Released(True, returned, self._pump(ticket.request_class, now))

    def cancel(self, request_class: str, key: int) -> bool:
        """Take a waiter out of its queue (its caller gave up); counts as a rejection."""
        queue = self.queues[request_class]
        for waiter in queue:
            if waiter.key == key:
                queue.remove(waiter)
                self.stats[request_class].rejected += 1
                return True
        return False

    def set_budgets(self, budgets: Mapping[str, int], now: float) -> list[tuple[Waiter, Ticket]]:
        self.ledger.set_budgets(budgets)
        for cls in budgets:
            self.queues.setdefault(cls, deque())
            self.stats.setdefault(cls, ClassStats())
        return [admitted for cls in budgets for admitted in self._pump(cls, now)]

    def retry_after_ms(self, request_class: str, cost: int, now: float) -> int:
        """When enough of the class budget should have drained for this request and those queued ahead."""
        account = self.ledger.account(request_class)
        needed = sum(w.cost for w in self.queues[request_class]) + cost - account.free
        releases = self.stats[request_class].releases
        recent = sum(c for t, c in releases if t >= now - RATE_WINDOW_S)
        if recent == 0:
            return UNKNOWN_RATE_RETRY_MS
        rate_per_ms = recent / (RATE_WINDOW_S * 1e3)
        return int(min(max(math.ceil(needed / rate_per_ms), MIN_RETRY_MS), MAX_RETRY_MS))

    def _admit(self, cls: str, waiter: Waiter, now: float) -> Ticket:
        self.ledger.take(cls, waiter.cost)
        self.stats[cls].admitted += 1
        ticket = Ticket(f"t{next(self._keys)}", cls, waiter.cost, waiter.arrived_at, now,
                        min(waiter.prefill_cost, waiter.cost))
        self.tickets[ticket.ticket_id] = ticket
        self.held[ticket.ticket_id] = ticket.cost
        return ticket

    def _pump(self, cls: str, now: float) -> list[tuple[Waiter, Ticket]]:
        admitted = []
        queue = self.queues[cls]
        while queue and self.ledger.fits(cls, queue[0].cost):
            waiter = queue.popleft()
            admitted.append((waiter, self._admit(cls, waiter, now)))
        return admitted
