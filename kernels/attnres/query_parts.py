"""The AttnRes sites' effective queries (pseudo-query x key-norm weight) as bf16 parts for tensor-core dots.

q_eff is float32; the block logits multiply it by bf16 blocks. Cut into bf16 parts whose sum is q_eff
exactly, the product is a few bf16 MMAs with float32 accumulation, as exact as float32 FMAs. The sites'
parameters do not change between forwards, so the parts are cut once (at load time, a derived weight)
instead of in every D step of every program. Plain torch: importing it does not import Triton.
"""

from __future__ import annotations

import torch


def query_part_count(queries: torch.Tensor, norm_weights: torch.Tensor | None) -> int:
    """bf16 parts that hold q_eff exactly: bf16 x bf16 has at most 16 significant bits (2 parts, the first
    rounded to nearest leaves a remainder of at most 8 bits), a bf16 query alone 1; anything else 3
    (float32's 24 bits)."""
    if queries.dtype != torch.bfloat16 or (norm_weights is not None and norm_weights.dtype != torch.bfloat16):
        return 3
    return 1 if norm_weights is None else 2


def query_parts(queries: torch.Tensor, norm_weights: torch.Tensor | None = None) -> torch.Tensor:
    """queries [S, D] (x key-norm weights [S, D]) -> parts [P, S, D] bf16, largest first, sum = q_eff."""
    rest = queries.float() * norm_weights.float() if norm_weights is not None else queries.float()
    parts = []
    for _ in range(query_part_count(queries, norm_weights)):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.stack(parts)
