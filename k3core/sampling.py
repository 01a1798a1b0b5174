"""Token sampling, per request in a batch: each request owns its parameters and its torch.Generator.

A request's draws depend only on its own logits and its own generator, never on which other requests
share the batch, so a seeded request gives the same tokens alone or batched (the serving tests rely on it).
Order of operations: temperature, then top-k, then top-p (nucleus) on the tempered distribution.
temperature == 0 is greedy (argmax; no randomness consumed).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None  # None: drawn from the OS

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: [V] float32+ probabilities."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
        keep_sorted = before < params.top_p  # the smallest prefix reaching top_p (always the top token)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum()
    return probs


class RequestSampler:
    """One request's sampling state."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> a token id."""
        if self.params.greedy:
            return int(logits.argmax())
        probs = filtered_probs(logits, self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sample_batch(logits: torch.Tensor, samplers: list[RequestSampler]) -> torch.Tensor:
    """logits [B, V], one sampler per row -> LongTensor [B]."""
    if logits.shape[0] != len(samplers):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(samplers)} samplers")
    return torch.tensor([s.sample(row) for s, row in zip(samplers, logits, strict=True)], dtype=torch.long)
