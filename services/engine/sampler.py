"""Per-request seeded sampling of the next token.

Token i of a request is drawn with a generator seeded from (seed, i) alone, so the draw does not depend
on batch composition, on which worker computed the logits, or on a preemption in between: a prefill
worker's first token and a decode worker's continuation are the tokens one offline run would produce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.params import GenerationOptions

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index + 1) & _MASK


def sample_next(logits: torch.Tensor, options: GenerationOptions, index: int) -> int:
    """logits [V] (float32) -> the token at output position `index`."""
    if options.temperature == 0:
        return int(torch.argmax(logits))
    generator = torch.Generator(device="cpu").manual_seed(token_seed(options.seed, index))
    return int(torch.multinomial(sampling_probs(logits, options).cpu(), 1, generator=generator))


def sample_rows(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]]) -> list[int]:
    """The tokens `sample_next(logits[row], options, index)` gives for each (row, options, index), with one
    argmax over the whole batch and one host copy for all greedy rows instead of a sync per row (sampled
    rows still draw from their own (seed, index) generator, through `sample_next` itself)."""
    greedy = [] if all(options.temperature != 0 for _, options, _ in rows) else logits.argmax(-1).tolist()
    return [greedy[row] if options.temperature == 0 else sample_next(logits[row], options, index)
            for row, options, index in rows]


def sampling_probs(logits: torch.Tensor, options: GenerationOptions) -> torch.Tensor:
    """The distribution a token is drawn from (temperature > 0): temperature, then top-k, then top-p."""
    scores = logits.float() / options.temperature
    if options.top_k and options.top_k < scores.numel():
        kth = torch.topk(scores, options.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if options.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= options.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
