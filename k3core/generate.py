"""Offline generation: the plain loop every serving path is compared against.

Each request is prefilled on its own (optionally in chunks), then all unfinished requests decode together
as one batch until each meets a stop token or its token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3core.model import K3Model
from k3core.sampling import RequestSampler, SamplingParams, sample_batch


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token (e.g. BOS)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    tokens: list[int]
    logprobs: list[float]  # log p(token) under the model's unmodified distribution
    finish_reason: str  # "stop" or "length"


def _logprob(logits: torch.Tensor, token: int) -> float:
    return float(torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)[token])


@torch.inference_mode()
def generate(
    model: K3Model, requests: list[GenerationRequest], prefill_chunk: int | None = None
) -> list[GenerationResult]:
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    device = model.lm_head.weight.device
    caches = [model.new_sequence_cache() for _ in requests]
    samplers = [RequestSampler(r.params, device) for r in requests]
    results = [GenerationResult([], [], "length") for _ in requests]
    last_logits = []
    for request, cache in zip(requests, caches, strict=True):
        prompt = torch.tensor(request.prompt, dtype=torch.long, device=device)
        step = prefill_chunk or len(prompt)
        for start in range(0, len(prompt), step):
            logits = model.prefill(prompt[start : start + step], cache, start)
        last_logits.append(logits[-1])
    active = list(range(len(requests)))
    logits = torch.stack(last_logits)
    while active:
        tokens = sample_batch(logits, [samplers[i] for i in active])
        still = []
        for row, i in enumerate(active):
            token = int(tokens[row])
            results[i].tokens.append(token)
            results[i].logprobs.append(_logprob(logits[row], token))
            if token in requests[i].stop_token_ids:
                results[i].finish_reason = "stop"
            elif len(results[i].tokens) < requests[i].max_new_tokens:
                still.append((row, i))
        if not still:
            break
        active = [i for _, i in still]
        next_tokens = torch.stack([tokens[row] for row, _ in still]).to(device)
        logits = model.decode(next_tokens, [caches[i] for i in active])
    return results
