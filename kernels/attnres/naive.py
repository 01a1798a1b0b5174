"""Plain-torch reference of the fused Block AttnRes merge + RMSNorm, composed from k3core.ops."""

from __future__ import annotations

import torch

from k3core.ops._common import acc_dtype
from k3core.ops.attnres import OnlineSoftmax, attnres_inter_from_logits, attnres_logits, attnres_merge
from k3core.ops.attnres import attnres_inter as _inter
from k3core.ops.norm import rms_norm


def attnres_merge_norm(
    stat_max: torch.Tensor | None, stat_denom: torch.Tensor | None, stat_acc: torch.Tensor | None,
    query: torch.Tensor, partial: torch.Tensor | None, out_norm_weight: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None, key_eps: float = 1e-6, out_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None, num_warps: int | None = None, store_h: bool = True,
    newest: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Reference of kernels.attnres.merge_norm_triton.attnres_merge_norm (num_warps ignored)."""
    del num_warps
    if stat_acc is None:  # nothing folded yet: the newest block is the first source
        dtype = acc_dtype(newest, query)
        stats = OnlineSoftmax(torch.full(newest.shape[:-1], float("-inf"), dtype=dtype, device=newest.device),
                              newest.new_zeros(newest.shape[:-1], dtype=dtype), newest.new_zeros(newest.shape, dtype=dtype))
    else:
        stats = OnlineSoftmax(stat_max.float(), stat_denom.float(), stat_acc)
    if newest is not None:
        logits = attnres_logits(query[None], newest[None], None if key_norm_weight is None else key_norm_weight[None],
                                key_eps)[0, 0]
        stats = stats.add(logits.to(stats.acc.dtype), newest.to(stats.acc.dtype))
    h = attnres_merge(stats, query, partial, key_norm_weight, key_eps)
    if partial is None:
        h = h.to(out_dtype or (stat_acc if stat_acc is not None else newest).dtype)
    return (h if store_h else None), rms_norm(h, out_norm_weight, out_eps)


def attnres_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
                  eps: float = 1e-6, block_d: int = 64, score_rows: int | None = None, num_warps: int = 4,
                  chunks: tuple[int, int] | None = None, apply_rows: int = 2, apply_block_d: int = 128,
                  fused: bool = False, stream_stores: bool = True, logits: torch.Tensor | None = None) -> OnlineSoftmax:
    """Reference of kernels.attnres.inter_triton.attnres_inter (tuning arguments ignored)."""
    del block_d, score_rows, num_warps, chunks, apply_rows, apply_block_d, fused, stream_stores
    if logits is not None:
        return attnres_inter_from_logits(logits, blocks)
    return _inter(queries, blocks, norm_weights, eps)


def attnres_block_logits(queries: torch.Tensor, block: torch.Tensor, norm_weights: torch.Tensor | None = None,
                         eps: float = 1e-6, out: torch.Tensor | None = None, rows: int | None = None,
                         sites: int | None = None, block_d: int = 64, chunks: int | None = None,
                         num_warps: int = 4, parts: torch.Tensor | None = None,
                         copy_to: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of kernels.attnres.block_logits_triton.attnres_block_logits (tuning arguments and the
    precomputed query parts ignored)."""
    del rows, sites, block_d, chunks, num_warps, parts
    if copy_to is not None:
        copy_to.copy_(block)
    logits = attnres_logits(queries, block.unsqueeze(0), norm_weights, eps)[:, 0]
    return logits if out is None else out.copy_(logits)
