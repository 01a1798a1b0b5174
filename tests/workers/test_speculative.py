"""Speculative decoding in the engine (in-process, nano on CPU, real paged pool and prefix cache).

Oracles: the tokens of a non-speculative run of the same worker (greedy: equal exactly), its prefix-cache
registrations (equal), and an offline contiguous computation of the generated sequences (every registered
MLA row and KDA checkpoint of the pool holds what plain prefill of those tokens gives).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from prometheus_client import REGISTRY

from k3.v1 import common_pb2
from k3core.cache.hashing import chain_hashes
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest, StepOutput
from services.engine.worker import Worker
from tests.workers.cluster import HASH_BLOCK, OVERRIDES
from tests.workers.oracle import build_reference, offline_generate

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(3)]
MAX_TOKENS = 16
SELF_DRAFT = ("--draft-model", "nano", "--draft-model-overrides", json.dumps(OVERRIDES))
OTHER_DRAFT = (*SELF_DRAFT, "--draft-weights-seed", "7")


def options(seed: int, max_tokens: int = MAX_TOKENS, temperature: float = 0.0,
            stop_token_ids: tuple[int, ...] = ()) -> GenerationOptions:
    params = common_pb2.SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                                       stop_token_ids=stop_token_ids)
    return GenerationOptions.from_proto(params, vocab_size=300, max_tokens_limit=999)


class Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason = 0
        self.error: Exception | None = None
        self.done = threading.Event()

    def __call__(self, out: StepOutput) -> None:  # on the engine thread: record, never raise there
        self.tokens += out.token_ids
        self.error = out.error
        if out.finish_reason or out.error:
            self.reason = out.finish_reason
            self.done.set()

    def wait(self) -> None:
        assert self.done.wait(120)
        assert self.error is None, self.error


@dataclass
class Run:
    tokens: list[list[int]]
    reasons: list[int]
    registrations: dict  # the prefix cache after every request finished
    proposed: int
    accepted: int
    cut_windows: int  # verify windows a stop condition cut short
    metric_proposed: float  # k3_decode_spec_* counters over this run
    metric_accepted: float


def run_engine(*flags: str, opts: list[GenerationOptions] | None = None, prompts: list[list[int]] = PROMPTS) -> Run:
    opts = opts or [options(i) for i in range(len(prompts))]
    config = WorkerConfig.load("decode", ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                          str(HASH_BLOCK), "--num-pages", "64", *flags], env={})
    worker = Worker(config, "decode")
    engine = worker.start(common_pb2.InstanceId(service="decode"))
    windows: list[tuple[int, int]] = []
    stream = engine._stream

    def observed(req, tokens, logprobs=None):  # (tokens offered, tokens taken) per streamed step
        windows.append((len(tokens), stream(req, tokens, logprobs)))
        return windows[-1][1]

    engine._stream = observed
    before = [metric(name) for name in ("draft_tokens", "accepted_tokens")]
    try:
        sinks = [Sink() for _ in prompts]
        for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
            engine.submit(EngineRequest(f"r{i}", prompt, opts[i], sink))
        for sink in sinks:
            sink.wait()
        sequences = [p + s.tokens[:-1] for p, s in zip(prompts, sinks, strict=True)]  # what was computed
        engine.call(lambda manager: None).result(10)  # one loop turn: the finished requests leave the pool
        registrations = engine.call(lambda manager: check_against_offline(manager, sequences)).result(60)
        spec = engine.speculator
        after = [metric(name) for name in ("draft_tokens", "accepted_tokens")]
        return Run([s.tokens for s in sinks], [s.reason for s in sinks], registrations,
                   spec.proposed if spec else 0, spec.accepted if spec else 0,
                   sum(taken < offered for offered, taken in windows), after[0] - before[0], after[1] - before[1])
    finally:
        worker.stop()


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(f"k3_decode_spec_{name}_total") or 0.0


@cache
def reference():
    return build_reference("nano", OVERRIDES)


@cache
def offline_states(tokens: tuple[int, ...]) -> tuple[dict[int, list], list[torch.Tensor]]:
    """Plain contiguous prefill of `tokens`, hash block by hash block: the KDA states at every boundary
    {tokens: [(conv, state) per KDA layer]} and the MLA rows of every MLA layer."""
    model = reference()
    sequence = model.new_sequence_cache()
    states = {}
    for start in range(0, len(tokens), HASH_BLOCK):
        chunk = tokens[start : start + HASH_BLOCK]
        model.prefill(torch.tensor(chunk), sequence, start)
        states[sequence.length] = [(sequence.kda_conv[i].clone(), sequence.kda_state[i].clone())
                                   for i in range(sequence.kda_state.shape[0])]
    rows = [sequence.mla_rows(i, len(tokens)).clone() for i in range(len(model.config.mla_layers))]
    return states, rows


def check_against_offline(manager, sequences: list[list[int]]) -> dict:
    """Every registered hash endpoint and KDA checkpoint holds what offline prefill of its sequence gives.
    Returns the registrations ({chain hash: (block index, hash blocks)}, {checkpoint key: boundary})."""
    layout, store = manager.layout, manager.store
    where = {h: (s, (j + 1) * HASH_BLOCK) for s, seq in enumerate(sequences)
             for j, h in enumerate(chain_hashes(seq, HASH_BLOCK))}
    offline = [offline_states(tuple(seq)) for seq in sequences]
    index = {}
    for chain_hash, endpoint in manager.index.items():
        seq, _ = where[chain_hash]
        block, covered = endpoint.block, endpoint.hash_blocks * HASH_BLOCK
        first = block.index * layout.tokens_per_block
        for layer, rows in enumerate(offline[seq][1]):
            group, slot = layout.mla_slot(layer)
            torch.testing.assert_close(store.mla_rows(block.pages[group], slot)[:covered],
                                       rows[first : first + covered], atol=2e-3, rtol=2e-3)
        index[chain_hash] = (block.index, endpoint.hash_blocks)
    checkpoints = {}
    for key, checkpoint in manager.checkpoints.by_key.items():
        seq, boundary = where[key]
        assert checkpoint.num_tokens == boundary
        for layer, (conv, state) in enumerate(offline[seq][0][boundary]):
            group, slot = layout.kda_slot(layer)
            page_conv, page_state = store.kda_views(checkpoint.pages[group], slot)
            torch.testing.assert_close(page_state, state, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(page_conv, conv.to(page_conv.dtype), atol=2e-3, rtol=2e-3)
        checkpoints[key] = boundary
    return {"index": index, "checkpoints": checkpoints, "free": manager.pool.num_free}


@pytest.fixture(scope="module")
def baseline() -> Run:
    return run_engine()


@pytest.mark.parametrize(("draft", "num_tokens"), [("target itself", 1), ("target itself", 3), ("target itself", 5),
                                                  ("other weights", 1), ("other weights", 5)])
def test_greedy_tokens_and_cache_equal_a_run_without_speculation(baseline, draft, num_tokens):
    flags = SELF_DRAFT if draft == "target itself" else OTHER_DRAFT
    run = run_engine(*flags, "--num-speculative-tokens", str(num_tokens))
    assert run.tokens == baseline.tokens
    assert all(len(t) == MAX_TOKENS for t in run.tokens)
    assert run.registrations == baseline.registrations  # and both equal the offline computation
    assert run.proposed > 0
    if draft == "target itself":
        assert run.accepted == run.proposed  # acceptance rate 1
    else:
        assert run.accepted / run.proposed < 0.1  # a draft with other weights practically never agrees
    assert (run.metric_proposed, run.metric_accepted) == (run.proposed, run.accepted)
    assert REGISTRY.get_sample_value("k3_decode_spec_acceptance_rate") == pytest.approx(run.accepted / run.proposed)


def _first_new(tokens: list[int], start: int) -> int:
    """The first position >= start whose token does not occur before it (a stop token that ends there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_and_max_tokens_inside_an_accepted_window(baseline):
    stop_at = _first_new(baseline.tokens[0], 2)
    second_stop = _first_new(baseline.tokens[2], 4)
    opts = [options(0, stop_token_ids=(baseline.tokens[0][stop_at],)), options(1, max_tokens=7),
            options(2, stop_token_ids=(baseline.tokens[2][second_stop],))]
    plain = run_engine(opts=opts)
    run = run_engine(*SELF_DRAFT, "--num-speculative-tokens", "5", opts=opts)
    assert run.tokens == plain.tokens == [baseline.tokens[0][: stop_at + 1], baseline.tokens[1][:7],
                                          baseline.tokens[2][: second_stop + 1]]
    assert run.reasons == [common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH,
                           common_pb2.FINISH_REASON_STOP]
    assert run.cut_windows >= 1  # a stop token ended a request inside a window the target had accepted
    assert run.registrations == plain.registrations


def test_sampled_requests_are_reproducible_and_cache_only_the_accepted_prefix():
    """Sampling with a draft of other weights accepts some drafts and rejects others; the same request alone
    gets the same tokens (per-position generators, not batch order), and the cache (checked against offline
    prefill inside `run_engine`) holds only the accepted prefixes."""
    opts = [options(i, temperature=1.5) for i in range(len(PROMPTS))]
    first = run_engine(*OTHER_DRAFT, "--num-speculative-tokens", "3", opts=opts)
    alone = run_engine(*OTHER_DRAFT, "--num-speculative-tokens", "3", opts=opts[1:2], prompts=PROMPTS[1:2])
    assert alone.tokens == first.tokens[1:2]
    assert 0 < first.accepted < first.proposed  # partial acceptance: replays of 0 < k < n drafts
    assert all(len(t) == MAX_TOKENS for t in first.tokens)


def test_a_verify_window_preempted_by_a_full_pool_resumes_with_exact_greedy_tokens():
    """7 pages: a long prompt (admitted first, prefilling 48-token chunks) runs out of pages while a short
    request (admitted second, decoding with verify windows in the remaining budget) holds drafts; the short
    one is the newest, so it is preempted with its window reserved, re-admitted through the prefix cache,
    and resumes (its draft cache then has nothing new to catch up). Both still equal offline greedy."""
    long_prompt, short_prompt = [(3 * j) % 250 + 1 for j in range(300)], [(5 * j) % 250 + 1 for j in range(8)]
    config = WorkerConfig.load("decode", ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                          str(HASH_BLOCK), "--num-pages", "7", "--step-token-budget", "56",
                                          *SELF_DRAFT, "--num-speculative-tokens", "3"], env={})
    worker = Worker(config, "decode")
    engine = worker.start(common_pb2.InstanceId(service="decode"))
    victims: list[bool] = []
    preempt = engine.scheduler._preempt

    def observed(req, plan):  # was the victim holding a verify window?
        victims.append(any(f.rid == req.rid for f in plan.verify))
        preempt(req, plan)

    engine.scheduler._preempt = observed
    try:
        first, second = Sink(), Sink()
        engine.submit(EngineRequest("long", long_prompt, options(0, max_tokens=8), first))
        engine.submit(EngineRequest("short", short_prompt, options(1, max_tokens=30), second))
        first.wait()
        second.wait()
        assert True in victims
        assert first.tokens == offline_generate(reference(), long_prompt, options(0, max_tokens=8))
        assert second.tokens == offline_generate(reference(), short_prompt, options(1, max_tokens=30))
        assert engine.call(lambda manager: None).result(10) is None
        assert engine.pool_usage() == 0.0
    finally:
        worker.stop()
