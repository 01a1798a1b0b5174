"""Log-probs on a speculative decode worker (in process, nano on CPU): every emitted token, whether an
accepted draft, a correction or the bonus token, carries its log-prob under the TARGET's distribution at its
position. Oracle: float64 log-softmax of the offline reference model's logits for the same tokens, after the
same temperature and top-k (`test_logprobs.oracle_logprobs`)."""

from __future__ import annotations

import json

import pytest

from k3.v1 import common_pb2
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest
from services.engine.worker import Worker
from tests.workers.cluster import HASH_BLOCK, OVERRIDES
from tests.workers.oracle import build_reference, offline_generate
from tests.workers.test_logprobs import check, oracle_logprobs, reference_logits
from tests.workers.test_speculative import OTHER_DRAFT, PROMPTS, SELF_DRAFT, Sink

SAMPLINGS = {"greedy": common_pb2.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3),
             "sampled": common_pb2.SamplingParams(temperature=1.3, top_k=40, seed=3, max_tokens=12, ignore_eos=True,
                                                  logprobs=True, top_logprobs=4)}


class LogprobSink(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[common_pb2.TokenLogprob] = []

    def __call__(self, out) -> None:
        self.logprobs += out.logprobs
        super().__call__(out)


@pytest.fixture(scope="module")
def reference():
    return build_reference("nano", OVERRIDES)


def serve(draft: tuple[str, ...], opts: GenerationOptions) -> tuple[list[LogprobSink], int, int]:
    config = WorkerConfig.load("decode", ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                          str(HASH_BLOCK), "--num-pages", "64", *draft,
                                          "--num-speculative-tokens", "3"], env={})
    worker = Worker(config, "decode")
    engine = worker.start(common_pb2.InstanceId(service="decode"))
    try:
        sinks = [LogprobSink() for _ in PROMPTS]
        for i, (prompt, sink) in enumerate(zip(PROMPTS, sinks, strict=True)):
            engine.submit(EngineRequest(f"lp{i}", prompt, opts, sink))
        for sink in sinks:
            sink.wait()
        return sinks, engine.speculator.proposed, engine.speculator.accepted
    finally:
        worker.stop()


@pytest.mark.parametrize("draft", ["target itself", "other weights"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculative_logprobs_are_the_targets(reference, draft, mode):
    sampling = SAMPLINGS[mode]
    opts = GenerationOptions.from_proto(sampling, vocab_size=reference.config.vocab_size, max_tokens_limit=999)
    sinks, proposed, accepted = serve(SELF_DRAFT if draft == "target itself" else OTHER_DRAFT, opts)
    assert proposed > 0
    if draft == "target itself":
        assert accepted > 0  # accepted drafts' log-probs are checked, not only the target's own tokens
    else:
        assert accepted < proposed  # corrections (residual draws when sampled) are checked too
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        assert len(sink.logprobs) == len(sink.tokens) == sampling.max_tokens
        if mode == "greedy":
            assert sink.tokens == offline_generate(reference, prompt, opts)
        logits = reference_logits(reference, prompt, sink.tokens)
        for lp, row, token in zip(sink.logprobs, logits, sink.tokens, strict=True):
            check(lp, oracle_logprobs(row, sampling.temperature, sampling.top_k), token, sampling.top_logprobs, 1e-4)
