"""Per-request seeded sampling of the next token.

Token i of a request is drawn with a generator seeded from (seed, i) alone, so the draw does not depend
on batch composition, on which worker computed the logits, or on a preemption in between: a prefill
worker's first token and a decode worker's continuation are the tokens one offline run would produce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.v1 import common_pb2
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


def log_distribution(logits: torch.Tensor, options: GenerationOptions) -> torch.Tensor:
    """Log-probabilities of the distribution a token is actually drawn from: the log-softmax of the raw
    logits when greedy, else of `sampling_probs` (tokens top-k / top-p removed are -inf)."""
    if options.temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(sampling_probs(logits, options))


def token_logprobs(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]]
                   ) -> list[common_pb2.TokenLogprob]:
    """For each (row, options, token drawn): the token's log-prob and its options.top_logprobs most likely
    alternatives, computed on the device for all rows together and copied to the host once."""
    if not rows:
        return []
    dists = torch.stack([log_distribution(logits[row], options) for row, options, _ in rows])
    drawn = torch.tensor([token for _, _, token in rows], device=dists.device)
    parts = [dists.gather(1, drawn[:, None])]
    k = max(options.top_logprobs for _, options, _ in rows)
    if k:
        top = torch.topk(dists, k, dim=-1)
        parts += [top.values, top.indices.to(dists.dtype)]  # ids < 2**24 are exact in float32
    host = torch.cat(parts, dim=1).tolist()  # the one host copy
    out = []
    for (_, options, token), values in zip(rows, host, strict=True):
        n = options.top_logprobs
        top_pairs = zip(values[1 + k:1 + k + n], values[1:1 + n], strict=True)
        out.append(common_pb2.TokenLogprob(token_id=token, logprob=values[0], top=[
            common_pb2.TokenAlternative(token_id=int(tid), logprob=lp)
            for tid, lp in top_pairs if lp != float("-inf")]))  # tokens that could not be drawn are no options
    return out
