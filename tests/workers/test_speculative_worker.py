"""Speculative decoding in real decode worker processes (flags on the command line, gRPC over loopback), at
TP 1 and TP 2 (every rank verifies and replays its own KDA heads): colocated Generate and the disaggregated
prefill -> transfer -> DecodeFromHandle path give the offline greedy tokens, and the worker exports its
k3_decode_spec_* metrics."""

from __future__ import annotations

import json

import pytest

from k3.v1 import common_pb2
from services.engine.params import GenerationOptions
from tests.support.metrics import scrape
from tests.workers.client import generate, prefill_then_decode
from tests.workers.cluster import OVERRIDES, make, running, worker_args
from tests.workers.oracle import build_reference, offline_generate

GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_workers(tmp_path_factory, transfer):
    root = tmp_path_factory.mktemp("spec")
    draft = ["--draft-model", "nano", "--draft-model-overrides", json.dumps(OVERRIDES), "--num-speculative-tokens", "4"]
    yield from running({"prefill": make(root, "prefill", worker_args("prefill", 1, transfer.address)),
                        1: make(root, "decode1", worker_args("decode", 1, transfer.address, *draft)),
                        2: make(root, "decode2", worker_args("decode", 2, transfer.address, *draft))})


@pytest.mark.parametrize("tp", [1, 2])
async def test_worker_with_a_draft_streams_the_offline_greedy_tokens(spec_workers, tp):
    reference = build_reference("nano", OVERRIDES)
    options = GenerationOptions.from_proto(GREEDY, vocab_size=300, max_tokens_limit=999)
    prompts = [[(9 * i + j + tp) % 250 + 1 for j in range(12 + 7 * i)] for i in range(2)]
    decode = spec_workers[tp]
    chunks = await generate(decode.address, "colocated", prompts[0], GREEDY)
    assert [t for c in chunks for t in c.token_ids] == offline_generate(reference, prompts[0], options)
    assert any(len(c.token_ids) > 1 for c in chunks)  # verify windows streamed several tokens at once
    assert chunks[-1].usage.completion_tokens == 20
    tokens, _ = await prefill_then_decode(spec_workers["prefill"].address, decode.address, "disaggregated",
                                          prompts[1], GREEDY)
    assert tokens == offline_generate(reference, prompts[1], options)
    metrics = scrape(decode.info["metrics_address"])
    assert metrics.value("k3_decode_spec_acceptance_rate") == 1.0  # the target is its own draft
    drafted, accepted = (metrics.value(f"k3_decode_spec_{n}_tokens_total") for n in ("draft", "accepted"))
    assert drafted == accepted > 0
    assert metrics.value("k3_decode_spec_tokens_per_step_count") > 0

