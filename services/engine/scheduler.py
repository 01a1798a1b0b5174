"""Continuous batching with chunked prefill over the paged pool (rank 0 decides, the plan carries it).

Every step: requests that ended leave, running requests get their next tokens (decode steps first, one
token each, then prefill chunks), and waiting requests join while the step's token budget, the running
limit and the pool allow. A prefill chunk that does not finish its prompt ends on a hash-block multiple,
so the KDA state at the end of every forward is a state the prefix cache may checkpoint.

Preemption (the pool is full): the newest running request is finished *with* its turn kept, which leaves
its registered MLA blocks and latest KDA checkpoint in the prefix cache (written back to the CPU tier if
they get evicted), and it goes back to the front of the queue. When it is admitted again, the two-phase
lookup restores it up to its last hash boundary and only the tail is recomputed. So preemption is
"offload through the prefix cache, recompute the tail", never a failure; a request that cannot fit even
alone is refused with RESOURCE_EXHAUSTED.

Speculative decoding: `offer_drafts` before `schedule` gives a decoding request with drafts a verify window
(its pending token and the drafts) in `plan.verify` instead of a one-token forward. Its pages are reserved
for the pending token first, preempting as usual; the drafts then need no further page (a window never
crosses a hash-block boundary, `Speculator.window`), so every rank replays the same calls.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Mapping

from k3core.cache.pool import OutOfPages
from services.engine.plan import ExportItem, ForwardItem, ImportItem, RecordingManager, StepPlan
from services.engine.request import EngineRequest, Phase


class Scheduler:
    def __init__(self, manager: RecordingManager, *, hash_block_tokens: int, max_running: int,
                 step_token_budget: int, model_name: str):
        self.manager = manager
        self.hash_block = hash_block_tokens
        self.max_running = max_running
        self.budget = step_token_budget
        self.model_name = model_name
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.preemptions = 0
        self.lookup_tokens = 0  # prompt tokens looked up in the prefix cache at first admission
        self.hit_tokens = 0
        self._pool_full = False
        # Requests that must leave before the next step: rid -> keep the turn's checkpoint.
        self._leaving: dict[str, bool] = {}
        # Filled by `schedule`: requests that could not be admitted even into an empty pool.
        self.rejected: list[EngineRequest] = []
        self._drafts: Mapping[str, list[int]] = {}

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: EngineRequest, keep_turn: bool) -> None:
        """The request ended (finished, cancelled, failed): its pages go at the next step."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.phase is Phase.RUNNING:
            self.running.remove(req)
            self._leaving[req.rid] = keep_turn
        req.phase = Phase.FINISHED

    def forget(self, req: EngineRequest) -> None:
        """The executor already released the request's pages (a failed import)."""
        if req in self.running:
            self.running.remove(req)
        self._leaving.pop(req.rid, None)
        req.phase = Phase.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._leaving)

    def offer_drafts(self, drafts: Mapping[str, list[int]]) -> None:
        """Draft tokens (rid -> drafts) for the next `schedule`: those requests' decode steps become verify
        windows (`plan.verify`) where the budget allows."""
        self._drafts = drafts

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self.rejected = []
        self.finish_leaving()
        budget = self.budget
        self._pool_full = False
        # Decode steps first (one token each, latency-critical), then prefill chunks, oldest first.
        for req in sorted(self.running, key=lambda r: (self._remaining(r) > 1, r.arrival)):
            if req.phase is not Phase.RUNNING:
                continue  # preempted earlier in this pass
            budget -= self._schedule_tokens(req, budget, plan)
        # Nothing joins in a step that had to preempt: the pool is the limit, not the queue.
        while not self._pool_full and self._admits_head(budget):
            req = self.waiting[0]
            outcome = self._admit(req, plan)
            if outcome == "wait":
                break
            self.waiting.popleft()
            if outcome == "admitted" and req.source is None:
                budget -= self._schedule_tokens(req, budget, plan, may_preempt=False)
        plan.manager_calls = self.manager.take_calls()
        self._drafts = {}
        return plan

    def admits_next(self, decode_rows: int, new_pages: int) -> bool:
        """Side-effect free: would the next `schedule` try to admit the head of the queue, when its running
        requests all decode (`decode_rows` tokens of the budget) and their reserves take `new_pages` pages
        without preempting? The admission loop's own test; the lookup it then runs (`add_request`) may
        still find too few pages for a prompt-cache hit and keep the request waiting."""
        return self._admits_head(self.budget - decode_rows, new_pages)

    def _admits_head(self, budget: int, pages_taken: int = 0) -> bool:
        """Whether the head of the queue is tried for admission with `budget` tokens left in the step and
        `pages_taken` pages of the pool still to be allocated by this step's reserves."""
        if not self.waiting or len(self.running) >= self.max_running or budget <= 0:
            return False
        # Cannot even hold its state and first block: it waits (and the lookup is not churned).
        manager = self.manager.manager
        need = manager.layout.num_kda_groups + manager.layout.num_mla_groups
        return not self.running or manager.pool.num_available - pages_taken >= need

    def finish_leaving(self) -> None:
        """Release the pages of the requests that ended since the last step (the start of every step)."""
        for rid, keep in self._leaving.items():
            self.manager.call("finish", rid, keep)
        self._leaving.clear()

    def _remaining(self, req: EngineRequest) -> int:
        cached = self.manager.manager.requests[req.rid]
        return cached.num_tokens - cached.num_computed

    def _chunk(self, req: EngineRequest, budget: int) -> int:
        """Tokens to compute this step: up to the budget, ending on a hash-block multiple whenever the
        chunk crosses one (so the state after the forward is a checkpointable boundary state); only the
        tail after the last boundary ends elsewhere."""
        cached = self.manager.manager.requests[req.rid]
        start = cached.num_computed
        end = start + min(cached.num_tokens - start, budget)
        if start < cached.branch_point < end:
            # Where this prompt's cached MLA match ran past its KDA hit: ending a forward there keeps a
            # checkpoint, so the next prompt sharing that prefix (a system prompt) hits all of it.
            end = cached.branch_point
        boundary = end // self.hash_block * self.hash_block
        if boundary > start:
            return boundary - start
        return end - start if end == cached.num_tokens else 0

    def _schedule_tokens(self, req: EngineRequest, budget: int, plan: StepPlan, may_preempt: bool = True) -> int:
        """Reserve this step's tokens of a running request, preempting newer ones if the pool is full. A
        request admitted in this very step preempts nobody: it goes back to the queue instead."""
        count = self._chunk(req, budget)
        if count == 0:
            return 0
        while True:
            try:
                self.manager.call("reserve", req.rid, count)
                break
            except OutOfPages:
                if not may_preempt:
                    self._requeue_new(req, plan)
                    return 0
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    return 0
        cached = self.manager.manager.requests[req.rid]
        start = cached.num_computed
        sample = start + count == cached.num_tokens
        drafts = self._drafts.get(req.rid)
        if drafts and count == 1 and sample and len(drafts) < budget:
            self.manager.call("append_tokens", req.rid, drafts)
            self.manager.call("reserve", req.rid, 1 + len(drafts))  # within the pending token's block
            plan.verify.append(ForwardItem(req.rid, [(req.output or req.prompt)[-1], *drafts], True))
            return 1 + len(drafts)
        plan.forward.append(ForwardItem(req.rid, _token_slice(req, start, start + count), sample))
        if sample and req.export is not None and not req.output:
            plan.exports.append(ExportItem(req.rid, req.export.handle_id, req.export.transfer_address,
                                           self.model_name))
        return count

    def _admit(self, req: EngineRequest, plan: StepPlan) -> str:
        """"admitted", "wait" (the pool is busy: stay queued), or "rejected" (cannot fit even alone). Called
        only where `_admits_head` holds."""
        tokens = req.prompt if req.source is not None else req.tokens
        try:
            fresh = req.prompt_chain is not None and len(tokens) == len(req.prompt)
            hit = self.manager.call("add_request", req.rid, tokens, chain=req.prompt_chain if fresh else None)
        except OutOfPages:
            if self.running:
                return "wait"
            req.phase = Phase.FINISHED
            self.rejected.append(req)
            return "rejected"
        if not req.preemptions:
            req.cached_tokens = hit
            self.lookup_tokens += len(tokens)
            self.hit_tokens += hit
        req.phase = Phase.RUNNING
        self.running.append(req)
        if req.source is not None:
            rest = len(req.prompt) - hit
            if rest:
                try:
                    self.manager.call("reserve", req.rid, rest)
                except OutOfPages:
                    self._requeue_new(req, plan)
                    self.waiting.popleft()  # the caller sees "wait" and keeps it at the front
                    return "wait"
            plan.imports.append(ImportItem(req.rid, req.source.handle_id, req.source.transfer_address, hit,
                                           bool(rest)))
        return "admitted"

    def _requeue_new(self, req: EngineRequest, plan: StepPlan) -> None:
        """Undo an admission of this step (nothing computed yet) and stop admitting."""
        self._pool_full = True
        self.running.remove(req)
        plan.imports[:] = [i for i in plan.imports if i.rid != req.rid]
        self.manager.call("finish", req.rid, False)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def _preempt(self, req: EngineRequest, plan: StepPlan) -> None:
        self._pool_full = True
        self.running.remove(req)
        plan.forward[:] = [f for f in plan.forward if f.rid != req.rid]
        plan.verify[:] = [f for f in plan.verify if f.rid != req.rid]
        plan.exports[:] = [e for e in plan.exports if e.rid != req.rid]
        plan.imports[:] = [i for i in plan.imports if i.rid != req.rid]
        self.manager.call("finish", req.rid, True)
        req.phase = Phase.WAITING
        req.preemptions += 1
        self.preemptions += 1
        # An imported request recomputes from its tokens (prefix hits permitting): the handle is gone.
        req.source = None
        self.waiting.appendleft(req)


def _token_slice(req: EngineRequest, start: int, end: int) -> list[int]:
    """req.tokens[start:end] without building req.tokens (prompt + output: a copy of the whole sequence
    per request and step)."""
    prompt = len(req.prompt)
    if start >= prompt:
        return req.output[start - prompt : end - prompt]
    return req.prompt[start:end] if end <= prompt else req.prompt[start:] + req.output[: end - prompt]


def new_handle_id() -> str:
    return "kv-" + uuid.uuid4().hex[:20]
