"""Block Attention Residuals (K3 report §2.2, eq.8-10).

Each AttnRes site l (before every attention, before every MLP, and once before the final norm) has a
learned pseudo-query w_l [D]. Its input is a softmax-weighted sum over sources v_i (the embedding b_0,
the completed block sums b_1..b_{n-1} and, after the first site of block n, the partial sum b_n^{i-1}):
    alpha_i = softmax_i(w_l . RMSNorm(v_i)),   h_l = sum_i alpha_i v_i
The keys are RMS-normalised so a source with a large magnitude cannot dominate; the values are not.
A learnable RMSNorm weight r_l folds into the query: w_l . (r_l * norm(v)) = (w_l * r_l) . norm(v).

Two-phase inference: the completed blocks are the same for every site of block n, so their logits for
all sites of the block are computed in one batched pass (`attnres_inter`), kept as online-softmax
statistics (max, denominator, accumulator), and each site merges in the single intra-block partial sum
(`attnres_merge`), never revisiting the block sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.ops._common import acc_dtype
from k3core.ops.norm import rms_norm


def _effective_query(
    query: torch.Tensor, norm_weight: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    q = query.to(dtype)
    return q * norm_weight.to(dtype) if norm_weight is not None else q


def attnres_direct(
    query: torch.Tensor, sources: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """eq.9 for one site: query [D], sources [S, ..., D] -> h [..., D] in the sources' dtype."""
    dtype = acc_dtype(sources, query)
    values = sources.to(dtype)
    logits = rms_norm(values, None, eps) @ _effective_query(query, norm_weight, dtype)  # [S, ...]
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(sources.dtype)


@dataclass
class OnlineSoftmax:
    """Running softmax-weighted sum: acc / denom, with every exponent taken relative to `max`."""

    max: torch.Tensor  # [...]
    denom: torch.Tensor  # [...]
    acc: torch.Tensor  # [..., D]

    def add(self, logits: torch.Tensor, values: torch.Tensor) -> OnlineSoftmax:
        """Fold in one more source: logits [...], values [..., D]."""
        new_max = torch.maximum(self.max, logits)
        old_scale, new_scale = (self.max - new_max).exp(), (logits - new_max).exp()
        return OnlineSoftmax(
            new_max,
            self.denom * old_scale + new_scale,
            self.acc * old_scale.unsqueeze(-1) + new_scale.unsqueeze(-1) * values,
        )

    def row(self, index: int) -> OnlineSoftmax:
        """The statistics of one site out of a batched `attnres_inter` result."""
        return OnlineSoftmax(self.max[index], self.denom[index], self.acc[index])

    def result(self) -> torch.Tensor:
        return self.acc / self.denom.unsqueeze(-1)


def attnres_logits(
    queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """q_eff . RMSNorm(b): queries [Q, D] against blocks [N, ..., D] -> logits [Q, N, ...] (accumulation dtype).
    Each logit depends only on its block and on the site's parameters, so a block's logits against every
    later site can be computed once, when the block is complete, and kept (see `attnres_inter_from_logits`)."""
    dtype = acc_dtype(blocks, queries)
    q = _effective_query(queries, norm_weights, dtype)  # [Q, D]
    return torch.einsum("n...d,qd->qn...", rms_norm(blocks.to(dtype), None, eps), q)


def attnres_inter_from_logits(logits: torch.Tensor, blocks: torch.Tensor) -> OnlineSoftmax:
    """Phase 1 from the logits [Q, N, ...] of the sites against blocks [N, ..., D] -> stats [Q, ...]."""
    values = blocks.to(logits.dtype)
    top = logits.max(dim=1).values
    weights = (logits - top.unsqueeze(1)).exp()
    return OnlineSoftmax(top, weights.sum(1), torch.einsum("qn...,n...d->q...d", weights, values))


def attnres_inter(
    queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None, eps: float = 1e-6
) -> OnlineSoftmax:
    """Phase 1: queries [Q, D] of all sites of a block against blocks [N, ..., D] -> stats [Q, ...]."""
    return attnres_inter_from_logits(attnres_logits(queries, blocks, norm_weights, eps), blocks)


def attnres_merge(
    inter: OnlineSoftmax,
    query: torch.Tensor,
    partial: torch.Tensor | None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Phase 2 for one site: merge the intra-block partial sum [..., D] (None at a block's first site)."""
    if partial is None:
        return inter.result().to(inter.acc.dtype)
    dtype = inter.acc.dtype
    values = partial.to(dtype)
    logits = rms_norm(values, None, eps) @ _effective_query(query, norm_weight, dtype)
    return inter.add(logits, values).result().to(partial.dtype)
