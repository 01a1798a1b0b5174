"""Prefill worker -> KV transfer -> decode worker, real processes, against the offline oracle."""

from __future__ import annotations

import asyncio

import pytest

from k3.v1 import common_pb2
from services.engine.params import GenerationOptions
from tests.workers.client import generate, prefill_then_decode
from tests.workers.cluster import OVERRIDES
from tests.workers.oracle import build_reference, offline_generate


@pytest.fixture(scope="module")
def reference():
    return build_reference("nano", OVERRIDES)


def expected(reference, prompt, sampling):
    options = GenerationOptions.from_proto(sampling, vocab_size=reference.config.vocab_size, max_tokens_limit=10_000)
    return offline_generate(reference, prompt, options)


async def _check_matches_oracle(workers, reference, p, q):
    # 70 tokens: prefill runs in chunks ending on 16-token hash blocks; sampled and greedy requests.
    cases = [(list(range(3, 73)), common_pb2.SamplingParams(temperature=0.9, top_k=40, seed=11 * p + q, max_tokens=10)),
             (list(range(40, 61)), common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))]
    results = await asyncio.gather(*(
        prefill_then_decode(workers["prefill", p].address, workers["decode", q].address, f"r{p}{q}{i}", prompt, sp)
        for i, (prompt, sp) in enumerate(cases)))
    for (prompt, sp), (tokens, prefilled) in zip(cases, results, strict=True):
        assert tokens == expected(reference, prompt, sp)
        assert prefilled.handle.layout.tp_size == p and prefilled.prompt_tokens == len(prompt)


@pytest.mark.parametrize(("p", "q"), [(1, 1), (2, 1), (1, 2)])
async def test_tokens_equal_offline_generation(workers, reference, p, q):
    await _check_matches_oracle(workers, reference, p, q)


@pytest.mark.slow
async def test_tokens_equal_offline_generation_tp4_to_tp2(workers_tp4, reference):
    await _check_matches_oracle(workers_tp4, reference, 4, 2)


async def test_colocated_generate_and_prefix_reuse(workers, reference):
    prompt = list(range(100, 150))
    sp = common_pb2.SamplingParams(temperature=0.7, seed=5, max_tokens=6, ignore_eos=True)
    first = await generate(workers["decode", 1].address, "c1", prompt, sp)
    again = await generate(workers["decode", 1].address, "c2", prompt, sp)
    want = expected(reference, prompt, sp)
    assert [t for c in first for t in c.token_ids] == want
    assert [t for c in again for t in c.token_ids] == want
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == 48  # the last full 16-token hash block below the 50-token prompt
    assert first[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
