"""The behaviour policy's log-probabilities, computed by the rollout driver.

The driver takes sampled tokens' log-probs from the worker's stream (`SamplingParams.logprobs`); this
model, kept at the weight version the workers serve, scores a segment only when the stream has none
(greedy decoding, or `DriverConfig.serving_logprobs` off), and scores
it under the exact distribution the engine samples from (`sampling_probs`: temperature, top-k, top-p).
Its forward is the contiguous reference path, so values agree with the worker's paged computation up to
float rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3.v1 import common_pb2
from k3core.model.k3model import K3Model
from k3core.weights.checkpoint import load_into
from services.engine.params import GenerationOptions
from services.engine.sampler import sampling_probs


class BehaviourPolicy:
    def __init__(self, model: K3Model, sampling: common_pb2.SamplingParams):
        self.model = model.eval()
        checked = common_pb2.SamplingParams()
        checked.CopyFrom(sampling)
        checked.max_tokens = 1  # set per request by the driver; only the distribution matters here
        self.options = GenerationOptions.from_proto(checked, vocab_size=model.config.vocab_size, max_tokens_limit=1)

    def load(self, location: str | Path) -> None:
        """The weights of a published version (strict: every tensor, the model's shapes)."""
        load_into(self.model, location)

    @torch.no_grad()
    def logprobs(self, context: list[int], segment: list[int]) -> list[float]:
        """log pi(segment[i] | context + segment[:i]) under the sampling distribution; greedy (temperature
        0) is deterministic, so every log-prob is 0."""
        if not segment:
            return []
        if self.options.temperature == 0:
            return [0.0] * len(segment)
        tokens = torch.tensor(context + segment)
        logits = self.model.prefill(tokens, self.model.new_sequence_cache(), 0)[len(context) - 1 : -1].float()
        return [float(torch.log(sampling_probs(row, self.options)[token]))
                for row, token in zip(logits, segment, strict=True)]
