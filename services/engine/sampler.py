"""Per-request seeded sampling of the next token, batched on the logits' device.

Token i of a request is a function of (seed, i) and its logits alone: a Gumbel-max draw whose noise for
column v is a fixed integer hash of (token_seed(seed, i), v), computed elementwise with int64 tensor ops.
So the draw does not depend on batch composition, on which worker (or device) computed the logits, or on a
preemption in between: a prefill worker's first token and a decode worker's continuation are the tokens one
offline run would produce (`sample_next`, the one-row case of `sample_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from k3.v1 import common_pb2
from k3core.host_copy import HostCopy
from k3core.mix import GOLDEN63, MASK63, mix63_, position_keys
from kernels import dispatch
from services.engine.params import GenerationOptions

_CPU_CHUNK, _DEVICE_CHUNK = 1 << 18, 1 << 24  # elements per row chunk of the noise


def token_seed(seed: int, index: int) -> int:
    return (seed * GOLDEN63 + index + 1) & MASK63


@functools.lru_cache(maxsize=8)
def column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """(v + 1) * golden ratio mod 2**63 for every column v: the same for every draw on a device, so it is
    built once per (vocab, device) instead of per sampled step (read only: `noise_bits` adds into a copy)."""
    return position_keys(0, vocab, device)


def noise_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 in [0, 2**63) (token seeds) -> [R, vocab] int64 in [0, 2**63): a bijective mix of
    key + (v + 1) * golden ratio (mod 2**63) per column v; int64 products wrap, the mask keeps 63 bits."""
    return mix63_(column_keys(vocab, keys.device).add(keys[:, None]).bitwise_and_(MASK63))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log(-log u) per (key, column), u = (2 * top 52 bits + 1) / 2**53: float64, exact and strictly
    inside (0, 1), so the noise is finite and ulp-level rounding differences between devices or vectorised
    and scalar kernels cannot realistically reorder two columns."""
    odd = (noise_bits(keys, vocab) >> 11).mul_(2).add_(1)
    return odd.double().mul_(2.0 ** -53).log_().neg_().log_().neg_()


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small per-row host list on the logits' device without a stream sync (torch.tensor(..., device=)
    waits for the forward): an async copy queued behind it; pageable memory is staged before it returns."""
    return torch.tensor(values).to(device, non_blocking=True)


def sample_next(logits: torch.Tensor, options: GenerationOptions, index: int) -> int:
    """logits [V] -> the token at output position `index` (the one-row case of `sample_rows`)."""
    return sample_rows(logits[None], [(0, options, index)])[0]


def sample_rows(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]]) -> list[int]:
    """logits [B, V]; for each (row, options, index): the token at output position `index` of that row's
    request. Greedy rows take the argmax of the raw logits; sampled rows (temperature > 0) the Gumbel-max
    draw over `truncated_scores`, an exact draw from `sampling_probs`. One device pass for all rows and one
    host copy of all tokens."""
    return sample_rows_async(logits, rows).result()


class SampledTokens:
    """The tokens of `sample_rows_async`: the draw is queued on the device, its host copy in flight."""

    def __init__(self, device_tokens: torch.Tensor | None, rows: Sequence[tuple[int, GenerationOptions, int]],
                 sampled: list[int]) -> None:
        self._rows, self._sampled = rows, sampled
        # every row greedy, row i at logit row i (a decode batch): the host copy is the answer as it is
        self._in_order = not sampled and all(row == i for i, (row, _, _) in enumerate(rows))
        self._device = device_tokens
        self._copy = None if device_tokens is None else HostCopy(device_tokens)

    @property
    def all_greedy(self) -> bool:
        """No row is sampled: the tokens are the argmax of the logits' rows."""
        return not self._sampled

    def device_rows(self) -> torch.Tensor:
        """The tokens in row order, on the device (queued, no wait), for a draw whose rows are the logits'
        rows 0..n-1 in order (a decode step's)."""
        n = len(self._rows)
        if self._device is None:
            return torch.empty(0, dtype=torch.int64)
        if any(row != i for i, (row, _, _) in enumerate(self._rows)):
            raise ValueError("device_rows needs the draw's rows in logits order")
        if not self._sampled or len(self._sampled) == n:
            return self._device[:n]
        rows = self._device[:n].clone()
        rows[_to_device(self._sampled, rows.device)] = self._device[n:]
        return rows

    def result(self) -> list[int]:
        """The token of each row (waits for the device's draw and copy)."""
        return self.array().tolist()

    def array(self) -> np.ndarray:
        """`result` as an int64 array."""
        if self._copy is None:
            return np.empty(0, dtype=np.int64)
        landed = self._copy.wait()
        if self._in_order:
            return landed.numpy()[: len(self._rows)]
        host, rows = landed.tolist(), self._rows
        if not self._sampled:
            return np.array([host[row] for row, _, _ in rows], dtype=np.int64)
        drawn = dict(zip(self._sampled, host[len(host) - len(self._sampled):], strict=True))  # after the argmax
        return np.array([drawn[i] if i in drawn else host[row] for i, (row, _, _) in enumerate(rows)], dtype=np.int64)


def sample_rows_async(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]],
                      greedy: torch.Tensor | None = None) -> SampledTokens:
    """`sample_rows` without waiting: the draw is queued on the logits' device and its tokens copied to
    pinned host memory behind it (no sync), so the host can work on while the device computes. `greedy`: the
    argmax of every logits row (`dispatch.greedy_argmax(logits)`) already on the device (the decode graph's,
    `DecodeFastPath.drawn_argmax`), taken instead of launching it; with every row greedy and in order, the
    tokens' device tensor is that one (read it before it is overwritten: the copy to the host is queued here)."""
    if not rows:
        return SampledTokens(None, rows, [])
    sampled = [i for i, (_, options, _) in enumerate(rows) if options.temperature != 0]
    if len(sampled) == len(rows):
        parts = []
    else:  # on the critical path
        parts = [dispatch.greedy_argmax(logits) if greedy is None else greedy]
    if sampled:
        at = [rows[i][0] for i in sampled]
        chosen = logits if at == list(range(len(logits))) else logits[_to_device(at, logits.device)]
        parts.append(_gumbel_max(chosen, [rows[i][1] for i in sampled], [rows[i][2] for i in sampled]))
    return SampledTokens(torch.cat(parts) if len(parts) > 1 else parts[0], rows, sampled)


def _gumbel_max(logits: torch.Tensor, options: Sequence[GenerationOptions], indices: Sequence[int]) -> torch.Tensor:
    keys = _to_device([token_seed(o.seed, i) for o, i in zip(options, indices, strict=True)], logits.device)
    scores = truncated_scores(logits, options)
    vocab = scores.shape[-1]
    # Row chunks bound the noise's temporaries (a few float64/int64 copies of a chunk): on a GPU to ~128 MB
    # each (64 rows of 163,840 columns are one pass), on a CPU to ~2 MB so the dozen elementwise passes stay
    # in cache (2x faster at 64 x 163,840 here). Elementwise, so the chunking changes no value.
    step = max(1, (_CPU_CHUNK if scores.device.type == "cpu" else _DEVICE_CHUNK) // vocab)
    # log p differs from the scores by a per-row constant, which leaves the argmax alone.
    return torch.cat([scores[i:i + step].double().add_(gumbel_noise(keys[i:i + step], vocab)).argmax(-1)
                      for i in range(0, len(keys), step)])


def truncated_scores(logits: torch.Tensor, options: Sequence[GenerationOptions]) -> torch.Tensor:
    """logits [R, V], one options (temperature > 0) per row -> float32 logits / temperature with the tokens
    top-k, then top-p remove set to -inf. Top-k keeps scores >= the k-th largest; top-p the smallest prefix
    of the (stably) sorted probabilities whose mass before each token is < top_p (always the top token)."""
    device, vocab = logits.device, logits.shape[-1]
    scores = logits.float() / _to_device([o.temperature for o in options], device)[:, None]
    top_k = [o.top_k if 0 < o.top_k < vocab else 0 for o in options]
    if any(top_k):
        kth = torch.topk(scores, max(top_k), dim=-1).values
        at = _to_device([max(k - 1, 0) for k in top_k], device)[:, None]
        off = _to_device([k == 0 for k in top_k], device)[:, None]
        scores = scores.masked_fill((scores < kth.gather(1, at)) & ~off, float("-inf"))
    nucleus = [i for i, o in enumerate(options) if o.top_p < 1.0]
    if nucleus:
        at = _to_device(nucleus, device)
        top_p = _to_device([options[i].top_p for i in nucleus], device)[:, None]
        rows = scores[at]
        sorted_probs, order = torch.sort(torch.softmax(rows, dim=-1), dim=-1, descending=True, stable=True)
        outside = torch.cumsum(sorted_probs, -1) - sorted_probs >= top_p
        scores[at] = rows.masked_fill(torch.zeros_like(outside).scatter_(1, order, outside), float("-inf"))
    return scores


def sampling_probs(logits: torch.Tensor, options: GenerationOptions) -> torch.Tensor:
    """logits [V] -> the (normalised) distribution a sampled token is drawn from: temperature, top-k, top-p."""
    return torch.softmax(truncated_scores(logits[None], [options])[0], dim=-1)


def log_distributions(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]]) -> torch.Tensor:
    """[len(rows), V]: per (row, options, _), the log-probabilities of the distribution its token is actually
    drawn from: the log-softmax of the raw logits when greedy, else the log of `sampling_probs` (tokens
    top-k / top-p removed are -inf). All rows in one pass (`truncated_scores` is batched)."""
    at = [row for row, _, _ in rows]
    picked = logits if at == list(range(len(logits))) else logits[_to_device(at, logits.device)]
    dists = torch.log_softmax(picked.float(), dim=-1)
    sampled = [i for i, (_, options, _) in enumerate(rows) if options.temperature != 0]
    if sampled:
        index = _to_device(sampled, logits.device)
        scores = truncated_scores(picked[index], [rows[i][1] for i in sampled])
        dists[index] = torch.softmax(scores, dim=-1).log_()
    return dists


def token_logprobs(logits: torch.Tensor, rows: Sequence[tuple[int, GenerationOptions, int]]
                   ) -> list[common_pb2.TokenLogprob]:
    """For each (row, options, token drawn): the token's log-prob and its options.top_logprobs most likely
    alternatives, computed on the device for all rows together and copied to the host once."""
    if not rows:
        return []
    dists = log_distributions(logits, rows)
    drawn = _to_device([token for _, _, token in rows], dists.device)
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
