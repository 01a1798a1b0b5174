"""Decode steps that keep the device busy: step N+1 is planned while step N's forward runs.

A step's inputs are known before its tokens are, except the tokens themselves: while step N computes, the
host prepares N+1's input image for N's rows (KDA slots, page tables, positions: `DecodeFastPath.prepare`)
and the precomputed stop-check tables. When N's tokens reach the host, only this runs before N+1's launch:

1. the stop check, vectorised: a row is a *candidate* if its token is any row's stop token id or the EOS,
   if it has stop strings, or if the token reaches its max_tokens; candidates (and only they) go through
   the engine's full acceptance (output processing; a request that ends is finished as in a plain step);
2. the requests that ended (here or by a cancellation) leave the cache manager, as at the start of a
   plain step; their rows leave the prepared image (the rest move up, as a fresh build for the remaining
   rows would place them), so a request that stopped is never advanced by an extra step: its KDA state,
   updated in place, stays the one its last token left, which is what the prefix cache keeps as its turn
   checkpoint, and the batch is the one a plain step runs;
3. rows whose next token starts a new block accept their token and reserve the block (in the plain
   schedule's order, so pages are allocated as a plain step allocates them), their image rows refreshed;
4. the tokens are written into the image, and N+1 is launched; its draw is queued behind it.

Then, while N+1 computes: the other rows' tokens are accepted (streamed text, metrics, the manager's
`append_tokens`, then their one-token `reserve`), N+1's forward is marked done in the manager, N's outputs
are handed to the streams, N+2 is prepared, and only then the manager's step is committed (a checkpoint
taken at a hash boundary has its checksum queued there behind N+1's forward, not waited for: the values
reach the checkpoint when first read, `PrefixCacheManager.settle_fingerprints`). The manager sees the
calls of a plain step (a row's append before its reserve, the finishes before any allocation); only
reserves that allocate nothing move after the launch. Token i of a request is drawn from the logits of the same forward as in a plain step,
with the same (seed, i): the streams are the plain engine's.

A step goes back to the plain path (its tokens accepted in full first: `settle`) whenever the next step is
not a decode step of the same rows: a waiting request would be admitted (`Scheduler.admits_next`: one
that must wait for pages or budget keeps the steps overlapped), a cross-thread `Engine.call` must run between
steps, a request is cancelled (its in-flight token may end it, as it would have in the plain loop), the
pool cannot give the new blocks without preempting, logprobs or forced tokens are asked for, the budget is
smaller than the batch. Only at TP 1 (ranks > 0 would need the plan before the tokens) without a
draft model, and only on the decode fast path. K3_DECODE_OVERLAP=0 turns it off. Why a step runs plain is
kept in `why_plain` (a `metrics.Fallback` label) and counted by the engine when that step runs
(`PipelineMetrics`: steps by mode, fallbacks by stage and reason).

With the look-ahead (decode_lookahead.py; the default, K3_DECODE_LOOKAHEAD=0 turns it off), an eligible step
is launched before the in-flight step's tokens are in, its tokens and stop check on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from services.engine.decode_fastpath import overlap_wanted
from services.engine.decode_lookahead import DecodeLookahead
from services.engine.executor import StepResult
from services.engine.metrics import Fallback
from services.engine.plan import StepPlan
from services.engine.request import EngineRequest, Phase
from services.engine.sampler import SampledTokens, sample_rows_async
from services.engine.trace_labels import label

if TYPE_CHECKING:
    from services.engine.engine import Engine


@dataclass
class InFlight:
    """A launched decode step whose tokens are not yet accepted, and the next step prepared for its rows."""

    requests: list[EngineRequest]  # the step's sampling rows = the prepared image's rows, in order
    tokens: SampledTokens  # one per request, in order
    image: np.ndarray
    size: int  # rows of the image (bucket)
    crossing: list[int]  # image rows whose next position starts a block not reserved yet
    always_check: np.ndarray  # [rows] bool: stop strings, or the token reaches max_tokens
    stop_ids: np.ndarray  # every row's stop token ids and the EOS: a row holding one is checked
    rows: np.ndarray | None = None  # the row of `tokens` of each request (a look-ahead step's), None: in order
    stops: tuple[np.ndarray, np.ndarray] | None = None  # with the look-ahead: its stop table (`stop_table`)

    def token_array(self) -> np.ndarray:
        """The requests' tokens, in order (waits for the device's draw)."""
        tokens = self.tokens.array()
        return tokens if self.rows is None else tokens[self.rows]


def _plain(req: EngineRequest) -> bool:
    return req.phase is Phase.RUNNING and not req.forced and not req.options.logprobs


def stop_hits(tokens: np.ndarray, stop_ids: np.ndarray) -> np.ndarray:
    """tokens [rows] -> bool [rows]: the token is one of `stop_ids` (`np.isin`). On the launch's critical path:
    a few ids (the EOS, a request's stop ids) are compared one by one (~1 us each at batch 256; `np.isin`
    sorts and took 12-33 us here)."""
    if len(stop_ids) > 8:
        return np.isin(tokens, stop_ids)
    if not len(stop_ids):
        return np.zeros(len(tokens), dtype=bool)
    hits = tokens == stop_ids[0]  # mostly the EOS alone
    for stop in stop_ids[1:].tolist():
        hits |= tokens == stop
    return hits


def plain_order(rows: list[int], requests: list[EngineRequest], running: list[EngineRequest]) -> list[int]:
    """`rows` (indices into `requests`) in the order a plain decode schedule visits their requests: by
    arrival, ties in `running`'s order (the scheduler's stable sort). O(n log n): the positions are looked
    up in a map built once (a `running.index` per key was quadratic when a whole batch crossed a block)."""
    if len(rows) < 2:
        return list(rows)
    position = {id(req): k for k, req in enumerate(running)}
    return sorted(rows, key=lambda i: (requests[i].arrival, position[id(requests[i])]))


class DecodeOverlap:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.enabled = (overlap_wanted() and engine.broadcast is None and engine.speculator is None
                        and engine.executor.fastpath is not None)
        self.inflight: InFlight | None = None
        # Why the next step runs plain (a `Fallback` label), counted by the engine when it runs; None: no
        # decode step was left (the overlap off, the engine idle, the rows all ended).
        self.why_plain: str | None = None
        fast = engine.executor.fastpath
        self.lookahead = DecodeLookahead(self) if self.enabled and fast.lookahead else None

    # ---- entering from a plain step ---------------------------------------------------------------------
    def eligible(self, plan: StepPlan) -> bool:
        """A plain step just launched `plan`: may its tokens be left in flight while the next is planned?
        If not, why (a `Fallback` label) is kept for the next step (`why_plain`)."""
        engine = self.engine
        if not self.enabled or not plan.forward:
            return False
        if plan.imports or plan.exports or plan.verify:
            return self._plain_next(Fallback.TRANSFER)
        if not all(len(f.token_ids) == 1 and f.sample for f in plan.forward):
            return self._plain_next(Fallback.PREFILL)
        if len(plan.forward) != len(engine.scheduler.running):
            return self._plain_next(Fallback.BATCH_CHANGED)
        if len(plan.forward) > engine.scheduler.budget:
            return self._plain_next(Fallback.BUDGET)
        requests = [engine.requests.get(f.rid) for f in plan.forward]
        if not all(r is not None and _plain(r) for r in requests):
            return self._plain_next(Fallback.BATCH_CHANGED if any(r is None or r.phase is not Phase.RUNNING
                                                                  for r in requests)
                                    else Fallback.FORCED if any(r.forced for r in requests) else Fallback.LOGPROBS)
        manager = engine.executor.manager
        if not engine.executor.fastpath.supports([manager.requests[f.rid] for f in plan.forward]):
            return self._plain_next(Fallback.UNSUPPORTED)
        return True

    def _plain_next(self, reason: str) -> bool:
        self.why_plain = reason
        return False

    def begin(self, plan: StepPlan, result: StepResult) -> None:
        requests = [self.engine.requests[f.rid] for f in plan.forward]
        drawn = [(row, req.options, len(req.output)) for row, req in enumerate(requests)]
        self.inflight = self._prepare(requests, self.draw(result.logits, drawn))

    def draw(self, logits, drawn: list) -> SampledTokens:
        """The draw of a decode step's rows (`sample_rows_async`), published on the device for a look-ahead. With
        the draw in the graph (`DecodeFastPath.drawn_argmax`) the greedy rows take the forward's own argmax, and
        a draw of greedy rows alone is already in `drawn`, where the graph wrote it: nothing to publish."""
        fast = self.engine.executor.fastpath
        greedy = fast.drawn_argmax(logits)
        tokens = sample_rows_async(logits, drawn, greedy)
        if self.lookahead is not None and (greedy is None or not tokens.all_greedy):
            fast.publish(tokens.device_rows())
        return tokens

    def _prepare(self, requests: list[EngineRequest], tokens: SampledTokens,
                 rows: np.ndarray | None = None) -> InFlight:
        """Step N+1's image for N's rows, all but the tokens, and the tables of the stop check (the host's, and
        with the look-ahead the device's)."""
        engine = self.engine
        manager = engine.executor.manager
        cached = [manager.requests[r.rid] for r in requests]
        image, size = engine.executor.fastpath.prepare(cached, len(cached))
        per_block = manager.layout.tokens_per_block
        crossing = [i for i, c in enumerate(cached) if c.num_computed >= len(c.blocks) * per_block]
        always = np.fromiter((bool(r.options.stop) or len(r.output) + 1 >= r.options.max_tokens for r in requests),
                             dtype=bool, count=len(requests))
        stop_ids = {t for r in requests for t in r.options.stop_token_ids}
        eos = engine.output.eos_token_id
        if eos is not None and not all(r.options.ignore_eos for r in requests):
            stop_ids.add(eos)
        stops = self.lookahead.stop_table(requests) if self.lookahead is not None else None
        return InFlight(requests, tokens, image, size, crossing, always, np.fromiter(stop_ids, dtype=np.int64), rows,
                        stops)

    # ---- leaving to a plain step ------------------------------------------------------------------------
    def settle(self, reason: str | None = None) -> None:
        """Accept the in-flight step's tokens in full (waiting for them) and drop the prepared step; the next
        step runs plain for `reason` (a `Fallback` label) if one was in flight."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            self.why_plain = reason
            self._accept_rows(inflight, inflight.token_array(), range(len(inflight.requests)))

    def _accept_rows(self, inflight: InFlight, tokens: np.ndarray, rows) -> None:
        for i in rows:
            req = inflight.requests[i]
            if req.phase is Phase.RUNNING:  # not cancelled meanwhile
                self.engine._take(req, int(tokens[i]))

    # ---- the overlapped step ----------------------------------------------------------------------------
    def advance(self) -> bool:
        """Launch the prepared step once the in-flight one's tokens are in; False (after settling) where the
        next step must be a plain one."""
        engine, inflight = self.engine, self.inflight
        assert inflight is not None
        ahead = self.lookahead.plan(inflight) if self.lookahead is not None else None
        if ahead is not None:
            self.lookahead.advance(inflight, *ahead)
            return True
        started = time.perf_counter()
        self.inflight = None
        with label("k3.tokens_ready"):
            tokens = inflight.token_array()  # the device finished step N
        with label("k3.to_launch"):  # the stop check, rows leaving or crossing a block, the tokens' write
            # From here to the launch the device idles: the common step (no candidate, no row leaving or crossing a
            # block) does a few array ops and the launch; the other cases pay for themselves only.
            candidates = inflight.always_check | stop_hits(tokens, inflight.stop_ids)
            if candidates.any():
                self._accept_rows(inflight, tokens, np.flatnonzero(candidates).tolist())
            requests = inflight.requests
            scheduler, manager = engine.scheduler, engine.executor.manager
            # rows only leave the running list while a step is in flight (nothing joins): equal lengths, all live
            live = range(len(requests)) if len(scheduler.running) == len(requests) else \
                [i for i, req in enumerate(requests) if req.phase is Phase.RUNNING]
            scheduler.finish_leaving()
            crossing = [i for i in inflight.crossing if requests[i].phase is Phase.RUNNING] if inflight.crossing else []
            fast = engine.executor.fastpath
            fits = all(len(manager.requests[requests[i].rid].blocks) < fast.builder.max_pages for i in crossing)
            new_pages = len(crossing) * manager.layout.num_mla_groups  # the crossing rows' reserves
            # the scheduler's own admission test: a request it cannot admit yet (pool, budget) leaves this step overlapped
            joins = scheduler.admits_next(len(live), new_pages)
            if (joins or not live or len(live) != len(scheduler.running) or len(live) > scheduler.budget or not fits
                    or new_pages > manager.pool.num_available):
                self._accept_rows(inflight, tokens, np.flatnonzero(~candidates).tolist())
                self.why_plain = Fallback.ADMISSION if joins else None if not live else \
                    Fallback.BATCH_CHANGED if len(live) != len(scheduler.running) else \
                    Fallback.BUDGET if len(live) > scheduler.budget else Fallback.MAX_PAGES if not fits else Fallback.POOL
                return False
            accepted = candidates  # rows whose token is taken before the launch
            image, size = inflight.image, inflight.size
            if crossing:  # rows whose token starts a block: accepted and reserved now, in the plain schedule's order
                accepted = candidates.copy()
                for i in plain_order(crossing, requests, scheduler.running):
                    if not accepted[i]:
                        engine._take(requests[i], int(tokens[i]))
                        accepted[i] = True
                    manager.reserve(requests[i].rid, 1)
            if len(live) < len(requests):  # the rows of requests that ended leave the batch, as in a plain step
                image, size = fast.compact(image, size, live)
            if crossing:
                at = {i: k for k, i in enumerate(live)}  # request row -> image row
                fast.builder.refresh(image, size, [manager.requests[requests[i].rid] for i in crossing],
                                     [at[i] for i in crossing])
            fast.builder.token_slots(image, len(live))[:] = tokens if len(live) == len(requests) else tokens[live]
            manager.pre_forward()
        with label("k3.launch"):
            logits = fast.launch(image, len(live))
        pipeline = engine.metrics.pipeline
        pipeline.overlap.inc()
        if self.lookahead is not None and self.lookahead.missed is not None:
            pipeline.not_ahead[self.lookahead.missed].inc()
        # ---- step N+1 runs: N's bookkeeping overlaps it
        taken = accepted.tolist()
        drawn = [(k, requests[i].options, len(requests[i].output) + (not taken[i])) for k, i in enumerate(live)]
        with label("k3.sample"):
            next_tokens = self.draw(logits, drawn)
        with label("k3.accept"):
            token_list = tokens.tolist()
            rest = [i for i in live if not taken[i]]
            engine._take_rows([(requests[i], token_list[i]) for i in rest])
            for i in rest:
                if requests[i].phase is not Phase.RUNNING:
                    raise RuntimeError(f"request {requests[i].rid!r} stopped on a token the stop check passed")
            reserved = set(crossing)
            for i in live:
                if i not in reserved:
                    manager.reserve(requests[i].rid, 1)  # directly: at TP 1 no rank replays the calls
            for i in live:
                manager.forward_done(requests[i].rid)
            engine.manager.take_calls()  # those made through the recording manager (finishes, appends): dropped too
        self._hand_over([requests[i] for i in live], next_tokens, None, started)
        return True

    def _hand_over(self, running: list[EngineRequest], next_tokens: SampledTokens, rows: np.ndarray | None,
                   started: float) -> None:
        """The end of an overlapped step (the overlap's or the look-ahead's), N+1 launched and N's tokens
        accepted: the outputs handed over, N+2 prepared for the requests still `running` (their N+1 tokens:
        `next_tokens`'s `rows`, None: in order), then N+1's step committed, the step's metrics."""
        engine = self.engine
        engine._flush()
        with label("k3.prepare_inputs"):
            if running:
                self.inflight = self._prepare(running, next_tokens, rows)
        # Last: a checkpoint taken at a hash boundary has its snapshot copies and checksum queued behind N+1's
        # forward, before N+2's launch.
        with label("k3.commit"):
            engine.executor.manager.commit_step()
        with label("k3.end_step"):
            engine._end_step(started)
