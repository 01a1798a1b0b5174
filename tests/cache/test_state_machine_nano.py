"""The state machine again, with the nano model as the model and the oracle: on sampled steps every
committed checkpoint and MLA endpoint is compared with the state that nano computes from scratch (over
its contiguous cache) on the entry's declared token prefix."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from k3core.cache.hashing import chain_hashes
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.pool import OutOfPages
from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.presets import preset

HB = 8
SCRIPT = [random.Random(9).randrange(256) for _ in range(48)]
TOL = {"rtol": 1e-4, "atol": 1e-4}  # chunking differs from the one-shot recompute: float reassociation


class NanoMachine(RuleBasedStateMachine):
    model: K3Model

    def __init__(self) -> None:
        super().__init__()
        f32 = torch.float32
        self.layout = plan_layout(shape_from_config(self.model.config, "nano"), 1, state_dtype=f32,
                                  conv_dtype=f32, mla_dtype=f32, hash_block_tokens=HB, min_tokens_per_block=24)
        self.manager = PrefixCacheManager(self.layout, num_pages=24, device="cpu", debug=True)
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.next_id = 0
        self.steps = 0

    def _learn(self, tokens: list[int]) -> None:
        for i, h in enumerate(chain_hashes(tokens, HB)):
            self.prefix_of.setdefault(h, tuple(tokens[: (i + 1) * HB]))

    @rule(length=st.integers(2, 44), tail=st.lists(st.integers(0, 255), max_size=3))
    def add_request(self, length: int, tail: list[int]) -> None:
        tokens = SCRIPT[:length] + tail
        self._learn(tokens)
        try:
            self.manager.add_request(f"r{self.next_id}", tokens)
        except OutOfPages:
            return
        self.next_id += 1

    @precondition(lambda self: self.manager.requests)
    @rule(budget=st.sampled_from([1, 8, 16]))
    def step(self, budget: int) -> None:
        rids, chunks = [], []
        for rid, req in list(self.manager.requests.items()):
            if req.num_computed == req.num_tokens:
                n = len(req.tokens)
                self.manager.append_tokens(rid, [SCRIPT[n] if n < len(SCRIPT) else 7])
                self._learn(req.tokens)
            n = self.manager.prefill_chunk(rid, budget)
            try:
                self.manager.reserve(rid, n)
            except OutOfPages:
                continue
            rids.append(rid)
            chunks += req.tokens[req.num_computed : req.num_computed + n]
        self.manager.pre_forward()
        if rids:
            with torch.no_grad():
                self.model(torch.tensor(chunks), self.manager.batch_view(rids))
            for rid in rids:
                self.manager.forward_done(rid)
        self.manager.commit_step()
        self.steps += 1

    @precondition(lambda self: self.manager.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.manager.finish(data.draw(st.sampled_from(sorted(self.manager.requests))))

    @rule(pages=st.integers(1, 8))
    def evict(self, pages: int) -> None:
        self.manager.evict_idle(pages)

    @invariant()
    def entries_match_nano_recompute(self) -> None:
        if self.steps % 3 or self.manager.step_open:
            return  # sampled steps only
        store, lay = self.manager.store, self.layout
        for checkpoint in list(self.manager.checkpoints.by_key.values()):
            if not checkpoint.ready:
                continue
            cache = self._recompute(self.prefix_of[checkpoint.key])
            for layer in range(len(self.model.config.kda_layers)):
                group, slot = lay.kda_slot(layer)
                conv, rec = store.kda_views(checkpoint.pages[group], slot)
                torch.testing.assert_close(rec, cache.kda_state[layer], **TOL)
                torch.testing.assert_close(conv, cache.kda_conv[layer], **TOL)
        for chain_hash, endpoint in self.manager.index.items():
            if endpoint.ready:
                prefix = self.prefix_of[chain_hash]
                cache = self._recompute(prefix)
                start, rows = endpoint.block.index * lay.tokens_per_block, endpoint.hash_blocks * HB
                for m in range(len(self.model.config.mla_layers)):
                    got = store.mla_rows(endpoint.block.pages[lay.mla_slot(m)[0]], lay.mla_slot(m)[1])[:rows]
                    torch.testing.assert_close(got, cache.mla_rows(m, len(prefix))[start : start + rows], **TOL)

    def _recompute(self, prefix: tuple[int, ...]):
        cache = self.model.new_sequence_cache()
        self.model.prefill(torch.tensor(prefix), cache, 0)
        return cache


@pytest.fixture(scope="module")
def nano() -> K3Model:
    torch.manual_seed(0)
    return init_weights(K3Model(preset("nano")), seed=0).eval()


def test_nano_state_machine(nano: K3Model) -> None:
    NanoMachine.model = nano
    NanoMachine.TestCase.settings = settings(max_examples=4, stateful_step_count=15, deadline=None,
                                             derandomize=True, suppress_health_check=list(HealthCheck))
    NanoMachine.TestCase().runTest()
