"""A TP-1 decode worker process with the decode fast path on this CPU (K3_DECODE_FASTPATH=1), where the
host/device overlap is on by default: concurrent gRPC streams (greedy, seeded, a stop token that ends one
mid-batch) equal k3core's offline generation, and the worker's /metrics count overlapped steps, steps by mode and fallbacks by reason."""

from __future__ import annotations

import asyncio

import pytest

from k3.v1 import common_pb2
from services.engine.params import GenerationOptions
from tests.support.metrics import scrape
from tests.workers.client import generate
from tests.workers.cluster import OVERRIDES, make, running, worker_args
from tests.workers.oracle import build_reference, offline_generate


@pytest.fixture(scope="module")
def overlap_worker(tmp_path_factory, transfer):
    proc = make(tmp_path_factory.mktemp("overlap"), "decode1", worker_args("decode", 1, transfer.address))
    proc.env.update({"K3_DECODE_FASTPATH": "1"})
    yield from running({1: proc})


async def test_streams_through_the_overlap_equal_the_offline_generation(overlap_worker):
    worker = overlap_worker[1]
    reference = build_reference("nano", OVERRIDES)
    vocab = reference.config.vocab_size
    prompts = [[(3 * i + 7 * j) % 250 + 1 for j in range(9 + 6 * i)] for i in range(3)]
    params = [common_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              common_pb2.SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
              common_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    free = offline_generate(reference, prompts[2], GenerationOptions.from_proto(params[2], vocab_size=vocab,
                                                                                max_tokens_limit=999))
    params[2].stop_token_ids.append(free[4])  # ends the third request mid-batch
    expected = [offline_generate(reference, p, GenerationOptions.from_proto(s, vocab_size=vocab, max_tokens_limit=999))
                for p, s in zip(prompts, params, strict=True)]
    chunks = await asyncio.gather(*(generate(worker.address, f"ov{i}", p, s)
                                    for i, (p, s) in enumerate(zip(prompts, params, strict=True))))
    assert [[t for c in cs for t in c.token_ids] for cs in chunks] == expected
    assert chunks[2][-1].finish_reason == common_pb2.FINISH_REASON_STOP
    metrics = scrape(worker.info["metrics_address"])
    # the steps by mode: the look-ahead's (on by default at TP 1) and the plain prefill and first decode steps
    steps = {mode: metrics.value("k3_decode_steps_total", {"mode": mode}) for mode in ("lookahead", "overlap", "plain")}
    assert steps["lookahead"] > 0 and steps["plain"] >= 2
    assert metrics.series("k3_decode_overlapped_steps_total") == []  # derivable: steps_total{mode} says it
    fallbacks = metrics.series("k3_decode_pipeline_fallbacks_total")
    assert metrics.value("k3_decode_pipeline_fallbacks_total", {"stage": "overlap", "reason": "prefill"}) >= 1
    assert metrics.value("k3_decode_pipeline_fallbacks_total", {"stage": "lookahead", "reason": "stop_ids"}) == 0
    # a plain step has at most one reason (none: the engine's first step, or one after idling)
    assert sum(v for labels, v in fallbacks if labels["stage"] == "overlap") <= steps["plain"]
