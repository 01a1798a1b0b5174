"""Quantile Balancing of the router bias (K3 report eq.14, appendices C and D).

For m tokens, n experts and top-k routing the target load is q = m k / n. Routing top-(k+1) on s + b
gives each token its cutoff alpha_i (the (k+1)-th biased score). The next bias of expert j is the one
that admits exactly q tokens when the cutoffs are held fixed: b_j = the q-th smallest required bias
r_ij = alpha_i - s_ij (appendix D; equivalently minus the (1 - k/n) quantile of the margins s - alpha),
then centred, since a common shift does not change any top-k.

`qb_update_exact` sorts all margins; `qb_histogram_counts` + `qb_bias_from_histogram` is the estimator
used at scale: additive per-expert bucket counts (sum them over ranks and micro-batches, e.g. with one
all-reduce) from which the quantile is read with linear interpolation inside the bucket.
"""

from __future__ import annotations

import math

import torch

from k3core.ops._common import acc_dtype


def qb_cutoffs(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """alpha [m]: the (k+1)-th largest biased score s_i + b of every token (scores [m, n] in (0, 1))."""
    if not 1 <= top_k < scores.shape[-1]:
        raise ValueError(f"QB needs 1 <= top_k < num_experts, got top_k={top_k}, n={scores.shape[-1]}")
    return (scores + bias).topk(top_k + 1, dim=-1).values[:, -1]


def _target_rank(num_tokens: int, num_experts: int, top_k: int) -> int:
    return max(1, math.ceil(num_tokens * top_k / num_experts))


def _centre(bias: torch.Tensor) -> torch.Tensor:
    return bias - bias.mean()


def qb_target_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """b_hat of eq.14 before centring: the (q+1)-th smallest r_ij = alpha_i - s_ij of each expert, so
    exactly q tokens have r_ij < b_hat_j (admitted: s_ij + b_hat_j > alpha_i) with the cutoffs fixed."""
    dtype = acc_dtype(scores)
    s, b = scores.to(dtype), bias.to(dtype)
    required = qb_cutoffs(s, b, top_k).unsqueeze(1) - s  # r [m, n]
    rank = _target_rank(s.shape[0], s.shape[1], top_k)
    return required.sort(dim=0).values[min(rank, s.shape[0] - 1)]


def qb_update_exact(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """eq.14 with exact order statistics: `qb_target_bias`, centred."""
    return _centre(qb_target_bias(scores, bias, top_k))


def qb_histogram_range(bias: torch.Tensor) -> tuple[float, float]:
    """(low, high) = (b_min - 1, b_max + 1): every r_ij lies inside since s in (0, 1) (appendix D)."""
    return float(bias.min()) - 1.0, float(bias.max()) + 1.0


def qb_histogram_counts(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, low: float, high: float, num_bins: int = 1000
) -> torch.Tensor:
    """Per-expert bucket counts H [n, B] of r_ij = alpha_i - s_ij over [low, high): additive across shards."""
    dtype = acc_dtype(scores)
    s, b = scores.to(dtype), bias.to(dtype)
    required = qb_cutoffs(s, b, top_k).unsqueeze(1) - s  # [m, n]
    width = (high - low) / num_bins
    buckets = ((required - low) / width).floor().long().clamp_(0, num_bins - 1)
    counts = torch.zeros(s.shape[1], num_bins, dtype=torch.long, device=s.device)
    return counts.scatter_add_(1, buckets.t(), torch.ones_like(buckets.t()))


def qb_bias_from_histogram(counts: torch.Tensor, low: float, high: float, top_k: int) -> torch.Tensor:
    """Read the ceil(q)-th smallest r per expert from H [n, B] (linear inside the bucket), centred."""
    num_experts, num_bins = counts.shape
    num_tokens = int(counts[0].sum())
    target = _target_rank(num_tokens, num_experts, top_k)
    width = (high - low) / num_bins
    cumulative = counts.cumsum(dim=1)
    bucket = (cumulative < target).sum(dim=1).clamp(max=num_bins - 1)  # first bucket reaching the target
    before = cumulative.gather(1, bucket.unsqueeze(1)).squeeze(1) - counts.gather(
        1, bucket.unsqueeze(1)
    ).squeeze(1)
    inside = counts.gather(1, bucket.unsqueeze(1)).squeeze(1).clamp(min=1)
    fraction = ((target - before) / inside).clamp(0.0, 1.0)
    return _centre(low + (bucket.double() + fraction.double()) * width)


def qb_update_histogram(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_bins: int = 1000
) -> torch.Tensor:
    """One QB step through the histogram estimator on a single shard (the multi-rank path sums counts)."""
    low, high = qb_histogram_range(bias)
    counts = qb_histogram_counts(scores, bias, top_k, low, high, num_bins)
    return qb_bias_from_histogram(counts, low, high, top_k).to(bias.dtype)


def expert_loads(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens routed to each expert [n] under top-k of s + b."""
    chosen = (scores + bias).topk(top_k, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=scores.shape[-1])
