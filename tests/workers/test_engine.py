"""The engine in-process (no gRPC): chunk boundaries, preemption under a full pool, cancellation."""

from __future__ import annotations

import json
import threading

import pytest

from k3.v1 import common_pb2
from k3core.cache.hashing import chain_hashes
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest, StepOutput
from services.engine.worker import Worker
from tests.workers.cluster import HASH_BLOCK, OVERRIDES
from tests.workers.oracle import build_reference, offline_generate


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()
        self.reason = 0

    def __call__(self, out: StepOutput) -> None:
        self.tokens += out.token_ids
        if out.finish_reason or out.error:
            self.reason = out.finish_reason
            self.done.set()


@pytest.fixture
def worker_factory():
    started: list[Worker] = []

    def make(*flags: str) -> Worker:
        config = WorkerConfig.load("decode", ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                              str(HASH_BLOCK), *flags], env={})
        worker = Worker(config, "decode")
        worker.start(common_pb2.InstanceId(service="decode"))
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


def _options(seed: int, max_tokens: int) -> GenerationOptions:
    return GenerationOptions.from_proto(common_pb2.SamplingParams(temperature=0.9, seed=seed, max_tokens=max_tokens,
                                                                  ignore_eos=True), vocab_size=300, max_tokens_limit=999)


def test_full_pool_preempts_and_results_still_equal_the_oracle(worker_factory):
    # 14 pages: each request needs 2 KDA state pages plus an MLA page per 48 tokens (and checkpoints), so
    # five 40-token prompts growing by 40 tokens cannot all stay resident.
    worker = worker_factory("--num-pages", "14", "--step-token-budget", "48")
    engine = worker.engine
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # observe every step
    prompts = [[(11 * i + j) % 250 + 1 for j in range(40)] for i in range(5)]
    collectors = [Collector() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, collectors, strict=True)):
        engine.submit(EngineRequest(f"p{i}", prompt, _options(i, 40), sink))
    assert all(c.done.wait(240) for c in collectors)
    assert engine.scheduler.preemptions > 0
    reference = build_reference("nano", OVERRIDES)
    for i in (0, 4):  # the first admitted and the last (which waited for room)
        assert collectors[i].tokens == offline_generate(reference, prompts[i], _options(i, 40)), f"request {i}"
    assert all(len(c.tokens) == 40 for c in collectors)
    # Chunks that stop short of the known tokens end on hash-block multiples (checkpointable states).
    chunks = [(f, p) for p in plans for f in p.forward if not f.sample]
    assert chunks
    assert all(len(f.token_ids) % HASH_BLOCK == 0 or len(f.token_ids) == 1 for f, _ in chunks)
    assert engine.pool_usage() == 0.0


def test_cancel_frees_pages_at_the_next_step(worker_factory):
    worker = worker_factory("--num-pages", "64")
    engine = worker.engine
    sinks = [Collector() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(EngineRequest(f"c{i}", list(range(1, 30)), _options(i, 500), sink))
    while not all(s.tokens for s in sinks):
        threading.Event().wait(0.02)
    assert engine.pool_usage() > 0
    for i in range(3):
        engine.cancel(f"c{i}")
    assert all(s.done.wait(10) for s in sinks)
    assert all(s.reason == common_pb2.FINISH_REASON_CANCELLED for s in sinks)
    assert engine.call(lambda manager: None).result(10) is None  # one loop turn later the pages are free
    assert engine.pool_usage() == 0.0


def test_a_call_cancelled_before_it_runs_is_skipped_and_the_engine_lives_on(worker_factory):
    """A caller that gave up cancels its future while the call waits in the inbox (a timed-out RPC): the engine
    must neither run it nor die setting a result on it (it did: InvalidStateError ended the loop)."""
    engine = worker_factory().engine
    gate, ran = threading.Event(), []
    blocker = engine.call(lambda manager: gate.wait(10))  # holds the loop so the next call stays queued
    queued = engine.call(lambda manager: ran.append(1))
    assert queued.cancel()
    gate.set()
    assert blocker.result(10) is True
    assert engine.call(lambda manager: "alive").result(10) == "alive"
    assert ran == [] and engine.failure is None


def test_a_shared_prefix_gets_a_checkpoint_at_its_branch_point(worker_factory):
    # A's prompt is cached with one checkpoint at its own end; B shares only the first 64 tokens, so its
    # lookup matches 64 MLA tokens but no KDA state there. B's forward must end at 64 and keep the state,
    # so C (the same 64 tokens, another tail) restores all 64 instead of recomputing them.
    worker = worker_factory("--num-pages", "96", "--step-token-budget", "256")
    engine = worker.engine
    shared = [(7 * j) % 250 + 1 for j in range(4 * HASH_BLOCK)]
    prompts = {name: shared + [(tail * 13 + j) % 250 + 1 for j in range(2 * HASH_BLOCK + 5)]
               for tail, name in enumerate("ABC", start=1)}
    reference = build_reference("nano", OVERRIDES)
    hits = {}
    for i, (name, prompt) in enumerate(prompts.items()):
        sink = Collector()
        request = EngineRequest(name, prompt, _options(i, 4), sink)
        engine.submit(request)
        assert sink.done.wait(120)
        hits[name] = request.cached_tokens
        assert sink.tokens == offline_generate(reference, prompt, _options(i, 4)), name
    assert hits["B"] < len(shared)  # nothing kept a state at the end of the shared part before B
    assert hits["C"] == len(shared)


def test_prompts_are_hashed_on_submit_not_inside_the_step(worker_factory):
    worker = worker_factory("--num-pages", "32")
    engine = worker.engine
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    prompt = [(5 * j) % 250 + 1 for j in range(3 * HASH_BLOCK + 7)]
    sink = Collector()
    engine.submit(EngineRequest("h", prompt, _options(0, 2), sink))
    assert sink.done.wait(60)
    admissions = [kwargs for p in plans for name, _, kwargs in p.manager_calls if name == "add_request"]
    # The chain handed to the cache (and replayed by every TP rank) is the prompt's own, independently hashed.
    assert admissions == [{"chain": chain_hashes(prompt, HASH_BLOCK)}]
