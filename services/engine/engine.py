"""The engine loop of rank 0: take requests, schedule a step, send it to the other ranks, run it, sample,
stream. Runs in its own thread; the gRPC servicers talk to it through `submit` and `cancel`."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from k3.v1 import common_pb2
from k3core.cache.hashing import chain_hashes
from services.engine.acceptance import accept_drafts
from services.engine.decode_overlap import DecodeOverlap
from services.engine.draft_runner import Proposal
from services.engine.executor import Executor, StepResult
from services.engine.heap import freeze_startup_heap, release_startup_heap
from services.engine.metrics import EngineMetrics, Fallback
from services.engine.output import OutputProcessor
from services.engine.plan import RecordingManager, StepPlan
from services.engine.request import EngineRequest, Phase, StepOutput
from services.engine.sampler import sample_rows, token_logprobs
from services.engine.scheduler import Scheduler
from services.engine.speculative import Speculator
from services.engine.token_streaming import TokenStreaming
from services.engine.trace_labels import label
from services.runtime import errors

log = logging.getLogger("k3.engine")

Broadcast = Callable[[StepPlan], None]


class Engine(TokenStreaming):
    def __init__(self, executor: Executor, scheduler: Scheduler, manager: RecordingManager,
                 output: OutputProcessor, metrics: EngineMetrics, broadcast: Broadcast | None = None,
                 speculator: Speculator | None = None):
        self.executor = executor
        self.speculator = speculator
        self.scheduler = scheduler
        self.manager = manager
        self.output = output
        self.metrics = metrics
        self.broadcast = broadcast
        self.requests: dict[str, EngineRequest] = {}
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopped = threading.Event()
        self.failure: BaseException | None = None
        self._preemptions_seen = 0
        self._step_tokens = 0  # streamed in this step: counted into the metrics once, at its end
        # Outputs for the request streams, handed over after the next step's launch (`_flush`).
        self._outbox: list[tuple[EngineRequest, StepOutput]] = []
        # Decode steps planned while the previous one computes (decode_overlap.py).
        self.overlap = DecodeOverlap(self)
        self._heap_held = False  # a `freeze_startup_heap` hold, given back at `stop`

    # ---- called from the server's event loop ----------------------------------------------------------
    def start(self) -> None:
        # after the warm-up (the worker builds the engine last): no full GC pass walks the startup heap
        frozen = freeze_startup_heap()
        self._heap_held = True
        log.info("startup heap frozen", extra={"objects": frozen})
        self._thread.start()

    def submit(self, req: EngineRequest) -> None:
        if self.failure is not None:
            raise errors.Unavailable(f"engine stopped: {self.failure}", retry_after_ms=1000)
        req.prompt_chain = chain_hashes(req.prompt, self.scheduler.hash_block)
        self._inbox.put(("add", req))

    def cancel(self, rid: str) -> None:
        self._inbox.put(("cancel", rid))

    def call(self, fn: Callable[[Any], Any], *, settle: bool = True) -> concurrent.futures.Future:
        """Run fn(cache manager) on the engine thread between steps (the manager is not thread-safe). With
        settle=False it may run while a decode step computes (its manager calls are all made by then): for
        reads such as a prefix lookup, not for anything the device reads (weights, pages)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, future, settle)))
        return future

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)
        if self._heap_held:  # unfrozen with the last hold: a stopped engine (cycles) can be collected
            self._heap_held = False
            release_startup_heap()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    # ---- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not self._has_work)
                if self._stopped.is_set():
                    break
                if self._has_work:
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - a dead engine must fail every stream, not hang them
            log.exception("engine loop died")
            self.failure = exc
            for req in list(self.requests.values()):
                self._fail(req, errors.Unavailable(f"worker engine failed: {exc}", retry_after_ms=1000))
        finally:
            self._flush()
            if self.broadcast is not None:
                try:
                    self.broadcast(StepPlan(shutdown=True))
                except Exception:  # noqa: BLE001 - peers may be gone already
                    pass
            self.executor.close()

    @property
    def _has_work(self) -> bool:
        return self.scheduler.has_work or self.overlap.inflight is not None

    def _drain_inbox(self, block: bool) -> None:
        if block:
            self._flush()  # idle: nothing to overlap the hand-over with
            self.overlap.why_plain = None  # the next step follows no decode step
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "stop":
                self._stopped.set()
                return
            if kind == "add":
                req = item
                assert isinstance(req, EngineRequest)
                if req.rid in self.requests:
                    self._emit(req, StepOutput([], error=errors.AlreadyExists(
                        f"request {req.rid!r} is already running")))
                    continue
                self.requests[req.rid] = req
                self.scheduler.add(req)
            elif kind == "call":
                fn, future, settle = item  # type: ignore[misc]
                # A caller that stopped waiting may have cancelled its future (a timed-out RPC): then nothing
                # runs, and no result is set on it (that raised InvalidStateError and killed this loop).
                if not future.set_running_or_notify_cancel():
                    continue
                if settle:
                    self.overlap.settle(Fallback.CALL)  # no step in flight (e.g. a weight reload)
                try:
                    result = fn(self.manager.manager)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            elif kind == "cancel":
                if str(item) in self.requests:
                    # its token of the step in flight first, as the plain loop has it (it may end the request)
                    self.overlap.settle(Fallback.CANCEL)
                req = self.requests.get(str(item))
                if req is not None:
                    self._finish(req, common_pb2.FINISH_REASON_CANCELLED, keep_turn=False)
                    self._emit(req, StepOutput([], finish_reason=common_pb2.FINISH_REASON_CANCELLED))

    def _step(self) -> None:
        if self.overlap.inflight is not None and self.overlap.advance():
            return
        started = time.perf_counter()
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator is not None else {}
        if proposals:
            self.scheduler.offer_drafts({rid: p.tokens for rid, p in proposals.items()})
        with label("k3.schedule"):
            plan = self.scheduler.schedule()
        for req in self.scheduler.rejected:
            self.requests.pop(req.rid, None)
            self._emit(req, StepOutput([], error=errors.ResourceExhausted(
                f"request {req.rid!r} needs more cache pages than this worker's whole pool",
                retry_after_ms=5000)))
        why_plain, self.overlap.why_plain = self.overlap.why_plain, None
        if plan.empty:
            self._flush()
            return
        if self.broadcast is not None:
            self.broadcast(plan)
        if plan.verify:
            self._verify(plan, proposals)
        with label("k3.execute"):
            result = self.executor.execute(plan)
        if plan.forward:  # a forward through the scheduler: a plain step (not one of cache calls alone)
            pipeline = self.metrics.pipeline
            pipeline.plain.inc()
            if why_plain is not None:
                pipeline.not_overlapped[why_plain].inc()
        self._flush()  # the previous step's outputs, while this step's forward runs (no sync before here)
        with label("k3.after_step"):  # plain: sample (waits for the device) and accept; overlapped: prepare
            if self.overlap.eligible(plan):
                self.overlap.begin(plan, result)  # its tokens are accepted by the next step, after its launch
            else:
                self._after_step(plan, result)
        with label("k3.end_step"):
            self._end_step(started)

    def _end_step(self, started: float) -> None:
        if self._step_tokens:
            self.metrics.record_tokens(self._step_tokens)
            self._step_tokens = 0
        self._update_gauges()
        self.metrics.step_seconds.observe(time.perf_counter() - started)

    def _after_step(self, plan: StepPlan, result: StepResult) -> None:
        for rid, why in result.failed_imports.items():
            req = self.requests.get(rid)
            if req is not None:
                self.scheduler.forget(req)
                self._fail(req, errors.Unavailable(f"could not import the KV handle: {why}", retry_after_ms=500))
        if plan.imports:
            self.executor.release_handles(plan)
        for item in plan.imports:
            req = self.requests.get(item.rid)
            if req is not None and item.rid not in result.failed_imports and req.forced and not req.output:
                self._accept_forced(req)
        for rid, why in result.failed_exports.items():
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, common_pb2.FINISH_REASON_ERROR, keep_turn=True)
                self._fail(req, errors.Unavailable(f"could not export the KV cache: {why}", retry_after_ms=500))
        live = [(row, self.requests.get(item.rid)) for row, item in enumerate(f for f in plan.forward if f.sample)]
        live = [(row, req) for row, req in live if req is not None and req.phase is Phase.RUNNING]
        drawn = [(row, req.options, len(req.output)) for row, req in live if not req.forced]
        if drawn:
            assert result.logits is not None
        # One batched draw (a single device sync for all greedy rows), then accept in row order.
        sampled = sample_rows(result.logits, drawn) if drawn else []
        asked = [(row, options, token) for (row, options, _), token in zip(drawn, sampled, strict=True)
                 if options.logprobs]
        logprobs = iter(token_logprobs(result.logits, asked))
        tokens = iter(sampled)
        for _, req in live:
            if req.forced:
                self._count_prompt(req)
                self._accept_forced(req)
            else:
                self._take(req, next(tokens), next(logprobs) if req.options.logprobs else None)

    def _verify(self, plan: StepPlan, proposals: dict[str, Proposal]) -> None:
        """Run the step's verify windows before the executor's forward (its step stays open until then):
        accept, stream, and advance each request's cache over what it kept."""
        assert self.speculator is not None
        verification = self.speculator.verifier.verify(plan.verify)
        kept: list[int] = []
        for item, logits in zip(verification.items, verification.logits, strict=True):
            req = self.requests[item.rid]
            proposal = proposals[item.rid]
            tokens = accept_drafts(logits, proposal.tokens, proposal.probs, req.options, len(req.output))
            self.speculator.record(len(proposal.tokens), len(tokens) - 1)
            # Token j of the window sits at logit row j: its log-prob under the target's distribution there
            # (a residual-drawn correction too: the model's probability of the token, docs/serving.md).
            logprobs = token_logprobs(logits, [(j, req.options, t) for j, t in enumerate(tokens)]
                                      ) if req.options.logprobs else None
            kept.append(self._stream(req, tokens, logprobs))
        self.speculator.verifier.commit(verification, kept)
        for item in verification.items:
            req = self.requests.get(item.rid)
            if req is not None and req.phase is Phase.RUNNING:
                self.manager.call("append_tokens", req.rid, req.output[-1:])  # the new pending token

    def _finish(self, req: EngineRequest, reason: int, keep_turn: bool) -> None:
        self._forget_draft(req.rid)
        self.scheduler.remove(req, keep_turn)
        self.requests.pop(req.rid, None)
        self.output.forget(req.rid)
        self.metrics.finished.labels(common_pb2.FinishReason.Name(reason)).inc()

    def _fail(self, req: EngineRequest, error: errors.ServiceError) -> None:
        if req.phase is not Phase.FINISHED:
            self.scheduler.remove(req, keep_turn=False)
        self._forget_draft(req.rid)
        self.requests.pop(req.rid, None)
        self.output.forget(req.rid)
        self.metrics.finished.labels("FINISH_REASON_ERROR").inc()
        self._emit(req, StepOutput([], error=error))

    def _forget_draft(self, rid: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(rid)

    def _update_gauges(self) -> None:
        pool = self.manager.manager.pool
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.pool_usage.set(self.pool_usage())
        self.metrics.pool_cached.set(pool.num_cached / pool.num_pages)
        self.metrics.preemptions.inc(self.scheduler.preemptions - self._preemptions_seen)
        self._preemptions_seen = self.scheduler.preemptions
        if self.scheduler.lookup_tokens:
            self.metrics.hit_rate.set(self.scheduler.hit_tokens / self.scheduler.lookup_tokens)

    def pool_usage(self) -> float:
        pool = self.manager.manager.pool
        return (pool.num_pages - pool.num_free - pool.num_cached) / pool.num_pages
