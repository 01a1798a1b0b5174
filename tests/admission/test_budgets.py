"""Budget properties under random operation sequences: in_use never exceeds budget, releases (the early
prefill part plus the final one) return exactly what admit took, a class's traffic never changes another
class's account, FIFO within a class."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.admission.ledger import REQUEST_CLASSES
from services.admission.scheduler import AdmissionScheduler, Rejection, Ticket, Waiter

classes = st.sampled_from(REQUEST_CLASSES)
operations = st.lists(st.one_of(
    st.tuples(st.just("offer"), classes, st.integers(0, 120), st.floats(0, 5), st.integers(0, 150)),
    st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("budget"), classes, st.integers(0, 300)),
    st.tuples(st.just("tick"), st.floats(0, 3)),
), max_size=80)
budget_maps = st.fixed_dictionaries({c: st.integers(0, 300) for c in REQUEST_CLASSES})


def accounts(s: AdmissionScheduler) -> dict[str, tuple[int, int, int]]:
    return {c: (a.budget, a.in_use, len(s.queues[c])) for c, a in s.ledger.accounts.items()}


@settings(max_examples=150, deadline=None)
@given(budget_maps, operations)
def test_budget_invariants(budgets, ops):
    s = AdmissionScheduler(budgets, max_queue=4)
    now = 0.0
    held: list[Ticket] = []
    returned: dict[str, int] = {}  # ticket id -> cost given back so far
    admitted_order: dict[str, list[int]] = {c: [] for c in REQUEST_CLASSES}
    queued_order: dict[str, list[int]] = {c: [] for c in REQUEST_CLASSES}
    deadlines: dict[int, tuple[str, float]] = {}  # queued waiter key -> (class, deadline)
    for op in ops:
        before = accounts(s)
        touched: set[str] = set()
        if op[0] == "offer":
            _, cls, cost, wait, prefill = op
            touched.add(cls)
            out = s.offer(cls, cost, now, now + wait, prefill)
            if isinstance(out, Ticket):
                held.append(out)
                assert out.cost == cost and out.prefill_cost == min(prefill, cost)
            elif isinstance(out, Waiter):
                queued_order[cls].append(out.key)
                deadlines[out.key] = (cls, now + wait)
            else:
                assert isinstance(out, Rejection) and out.retry_after_ms >= 0
        elif op[0] == "release" and held:
            index = op[1] % len(held)
            ticket, prefill_only = held[index], op[2]
            touched.add(ticket.request_class)
            in_use = s.ledger.accounts[ticket.request_class].in_use
            released = s.release(ticket.ticket_id, now, prefill_only)
            assert released.found
            returned[ticket.ticket_id] = returned.get(ticket.ticket_id, 0) + released.returned
            if prefill_only:
                # The early release gives back the prefill part once; the decode part stays held.
                assert returned[ticket.ticket_id] == ticket.prefill_cost
            else:
                held.pop(index)
                assert returned.pop(ticket.ticket_id) == ticket.cost
                assert not s.release(ticket.ticket_id, now).found  # a second release finds nothing
            admitted_cost = sum(t.cost for _, t in released.admitted)
            assert s.ledger.accounts[ticket.request_class].in_use == in_use - released.returned + admitted_cost
            for waiter, t in released.admitted:
                assert t.request_class == ticket.request_class
                admitted_order[t.request_class].append(waiter.key)
                held.append(t)
        elif op[0] == "budget":
            _, cls, value = op
            touched.add(cls)
            for waiter, t in s.set_budgets({cls: value}, now):
                admitted_order[cls].append(waiter.key)
                held.append(t)
        elif op[0] == "tick":
            # What the controller does when a waiter's queue timeout fires: take it out of its queue.
            now += op[1]
            admitted_keys = {k for keys in admitted_order.values() for k in keys}
            for key, (cls, deadline) in list(deadlines.items()):
                if deadline <= now:
                    del deadlines[key]
                    touched.add(cls)
                    assert s.cancel(cls, key) == (key not in admitted_keys)
        after = accounts(s)
        for cls in REQUEST_CLASSES:
            budget, in_use, _ = after[cls]
            outstanding = sum(t.cost - returned.get(t.ticket_id, 0) for t in held if t.request_class == cls)
            assert in_use == outstanding
            # Admission never pushes a class over its budget (a live cut may leave it over until drained).
            assert in_use <= max(budget, before[cls][1])
            if cls not in touched:
                assert after[cls] == before[cls]
    for cls in REQUEST_CLASSES:
        # Waiters of a class are admitted in the order they queued.
        keys = admitted_order[cls]
        assert keys == sorted(keys)
        assert set(keys) <= set(queued_order[cls])


def test_queued_request_is_admitted_when_budget_frees():
    s = AdmissionScheduler({"SHORT": 10, "LONG": 100})
    first = s.offer("SHORT", 8, 0.0, 1.0)
    assert isinstance(first, Ticket)
    waiter = s.offer("SHORT", 5, 0.0, 1.0)
    assert isinstance(waiter, Waiter)
    # LONG has its own budget: a big LONG request is admitted while SHORT is full.
    assert isinstance(s.offer("LONG", 100, 0.0, 1.0), Ticket)
    released = s.release(first.ticket_id, 0.5)
    assert released.found and released.returned == 8 and [w.key for w, _ in released.admitted] == [waiter.key]
    assert released.admitted[0][1].arrived_at == 0.0 and released.admitted[0][1].admitted_at == 0.5


def test_over_budget_without_wait_is_rejected_with_a_drain_based_hint():
    s = AdmissionScheduler({"SHORT": 100})
    tickets = [s.offer("SHORT", 10, 0.0, 0.0) for _ in range(10)]
    assert all(isinstance(t, Ticket) for t in tickets)
    # No release seen yet: the hint is the default.
    assert s.offer("SHORT", 10, 0.0, 0.0) == Rejection(
        "SHORT class over budget (100/100 in use, 0 queued)", 1_000)
    for t in tickets[:3]:
        s.release(t.ticket_id, 1.0)  # 30 units released in a 30 s window: 1 unit per second
    assert isinstance(s.offer("SHORT", 30, 1.0, 1.0), Ticket)
    out = s.offer("SHORT", 20, 1.0, 1.0)
    assert isinstance(out, Rejection) and out.retriable
    # 20 units must drain at 1 unit/s.
    assert out.retry_after_ms == 20_000


def test_request_larger_than_its_class_budget_is_not_retriable():
    out = AdmissionScheduler({"LONG": 50}).offer("LONG", 51, 0.0, 10.0)
    assert isinstance(out, Rejection) and not out.retriable and "exceeds" in out.reason


def test_queue_limit_and_cancel():
    s = AdmissionScheduler({"SHORT": 10}, max_queue=1)
    s.offer("SHORT", 10, 0.0, 0.0)
    queued = s.offer("SHORT", 1, 0.0, 2.0)
    assert isinstance(queued, Waiter)
    full = s.offer("SHORT", 1, 0.0, 2.0)
    assert isinstance(full, Rejection) and "queue full" in full.reason
    # The caller gave up: its waiter leaves the queue, counted as a rejection, and only once.
    assert s.cancel("SHORT", queued.key) and not s.cancel("SHORT", queued.key)
    assert len(s.queues["SHORT"]) == 0 and s.stats["SHORT"].rejected == 2
    assert isinstance(s.offer("SHORT", 1, 0.0, 2.0), Waiter)  # room in the queue again
