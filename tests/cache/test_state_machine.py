"""Random interleavings of the scheduler's cache operations, checked after every step against the
synthetic model's oracle: every committed entry (GPU endpoints, checkpoints, CPU-tier copies) holds exactly
the bytes of its declared token prefix, every running request's private state and blocks hold its computed
prefix, a hit restores exactly the hit prefix, and the pool's refcounts match the references held."""

from __future__ import annotations

import random

import pytest
import torch
from cache_oracle import PrefixOracle
from cache_synth import VOCAB, forward, tiny_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.hashing import chain_hashes
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.pool import OutOfPages

SESSIONS = [[random.Random(s).randrange(VOCAB) for _ in range(64)] for s in range(3)]
SESSIONS[1][:20] = SESSIONS[0][:20]  # a shared "system prompt" of five hash blocks


def _next_token(tokens: list[int], data: st.DataObject) -> int:
    """A sampled token: mostly the session's script (so the next turn extends this one), sometimes not."""
    for script in SESSIONS:
        if len(tokens) < len(script) and tokens == script[: len(tokens)] and data.draw(st.integers(0, 3)):
            return script[len(tokens)]
    return data.draw(st.integers(0, VOCAB - 1))


class CacheMachine(RuleBasedStateMachine):
    checks_run = 0  # invariant passes over all examples: one after every rule, plus one at the start

    def __init__(self) -> None:
        super().__init__()
        self.layout = tiny_layout(hash_block=4, tokens_per_block=12)
        page = self.layout.page_bytes
        self.manager = PrefixCacheManager(
            self.layout, num_pages=40, device="cpu", debug=True, cpu_tier=CpuTier(24 * page),
            policy=CheckpointPolicy(max_pool_fraction=0.5, waypoint_tokens=8))
        self.oracle = PrefixOracle(self.layout)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0
        self.entries_checked = 0

    # ---- rules --------------------------------------------------------------------------------------
    @rule(session=st.integers(0, 2), length=st.integers(1, 48), tail=st.lists(st.integers(0, VOCAB - 1),
                                                                             max_size=6))
    def add_request(self, session: int, length: int, tail: list[int]) -> None:
        tokens = SESSIONS[session][:length] + tail
        self.oracle.learn(tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        expected = self.manager.lookup(chain_hashes(tokens, 4), len(tokens))
        try:
            hit = self.manager.add_request(rid, tokens)
        except OutOfPages:
            return
        assert hit % 4 == 0 and hit < len(tokens) and hit <= expected.mla_tokens
        self.manager.pre_forward()  # restore copies land: the private state is the hit prefix's
        self.oracle.check_private(self.manager, rid, tokens)
        self.tokens[rid] = tokens

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduling step over a subset of the running requests (prefill chunks or decode)."""
        self._step(data, [r for r in self.tokens if data.draw(st.booleans())])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), decode=st.integers(0, 6))
    def run_to_turn_end(self, data: st.DataObject, decode: int) -> None:
        """Steps (with every running request) until one request has its prompt and `decode` generated
        tokens computed, then it finishes: its conversation so far becomes a reusable turn."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        target = len(self.tokens[rid]) + decode
        for _ in range(64):
            if self.manager.requests[rid].num_computed >= target:
                break
            self._step(data, list(self.tokens))
        self.finish_request(rid, turn=True)

    def _step(self, data: st.DataObject, rids: list[str]) -> None:
        scheduled, new_tokens = [], []
        for rid in rids:
            req = self.manager.requests[rid]
            if req.num_computed == req.num_tokens:  # decode: the sampled token becomes known
                token = _next_token(self.tokens[rid], data)
                self.manager.append_tokens(rid, [token])
                self.tokens[rid].append(token)
                self.oracle.learn(self.tokens[rid])
            n = self.manager.prefill_chunk(rid, data.draw(st.sampled_from([1, 4, 8, 13])))
            try:
                self.manager.reserve(rid, n)
            except OutOfPages:
                continue
            scheduled.append(rid)
            new_tokens.append(self.tokens[rid][req.num_computed : req.num_computed + n])
        self.manager.pre_forward()
        if scheduled:
            forward(self.manager.batch_view(scheduled), new_tokens)
            for rid in scheduled:
                self.manager.forward_done(rid)
        self.manager.commit_step()
        for rid in scheduled:
            self.oracle.check_private(self.manager, rid, self.tokens[rid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), turn=st.booleans())
    def finish(self, data: st.DataObject, turn: bool) -> None:
        self.finish_request(data.draw(st.sampled_from(sorted(self.tokens))), turn)

    def finish_request(self, rid: str, turn: bool) -> None:
        self.manager.finish(rid, turn_boundary=turn)
        del self.tokens[rid]

    @rule(pages=st.integers(1, 12))
    def evict(self, pages: int) -> None:
        self.manager.evict_idle(pages)

    @rule(session=st.integers(0, 2), length=st.integers(5, 64))
    def prefetch(self, session: int, length: int) -> None:
        tokens = SESSIONS[session][:length]
        self.manager.prefetch(chain_hashes(tokens, 4), len(tokens))

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def entries_hold_their_prefix(self) -> None:
        self.entries_checked += self.oracle.check(self.manager)
        CacheMachine.checks_run += 1

    @invariant()
    def refcounts_match_references(self) -> None:
        pool = self.manager.pool
        pool.check_invariants()
        if self.manager.step_open:
            return  # pins of this step's copies are still held
        held = [0] * pool.num_pages
        for req in self.manager.requests.values():
            for page in [p for b in req.blocks for p in b.pages] + req.state_pages:
                held[page] += 1
        assert held == pool.refcount

    @invariant()
    def checkpoints_all_groups_or_none(self) -> None:
        for checkpoint in self.manager.checkpoints.by_key.values():
            owners = {id(self.manager.pool.owner[p]) for p in checkpoint.pages}
            assert owners == {id(checkpoint)} and len(checkpoint.pages) == self.layout.num_kda_groups


def _run(examples: int, steps: int) -> int:
    """Run the machine; returns how many rule steps were checked."""
    CacheMachine.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck))
    torch.manual_seed(0)
    CacheMachine.checks_run = 0
    CacheMachine.TestCase().runTest()
    return CacheMachine.checks_run - examples


def test_cache_state_machine() -> None:
    assert _run(examples=15, steps=30) >= 300


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_cache_state_machine_long() -> None:
    assert _run(examples=250, steps=50) >= 10_000  # random interleavings, each step checked
