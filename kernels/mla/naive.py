"""Plain-torch reference of the paged MLA decode kernel, composed from k3core.ops.mla.

Attention in latent space is `mla_attention_absorbed` with identity up-projections (W_uk = W_uv = I): the
absorbed query already lives in the latent space and the kernel returns the latent-space output.
"""

from __future__ import annotations

import torch

from k3core.ops.mla import mla_attention_absorbed


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, seq: int, length: int) -> torch.Tensor:
    """The first `length` latent rows of sequence `seq`: [length, R+P]."""
    page_tokens = cache.shape[1]
    pages = page_table[seq, : -(-length // page_tokens)].long()
    return cache[pages].reshape(-1, cache.shape[-1])[:length]


def mla_decode_paged(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, scale: float,
    latent_dim: int = 512, num_splits: int | None = None, block_n: int = 32, num_warps: int = 4,
    num_stages: int = 5, tokens_major: bool = False, page_tiles: bool | None = None,
) -> torch.Tensor:
    """Reference of kernels.mla.decode_triton.mla_decode_paged (tuning arguments ignored)."""
    del num_splits, block_n, num_warps, num_stages, tokens_major, page_tiles
    B, H, _ = q.shape
    eye = torch.eye(latent_dim, dtype=torch.float32, device=q.device)
    identity_kv_b = torch.cat([eye, eye]).repeat(H, 1)  # per head [W_uk = I; W_uv = I], [H*2R, R]
    out = torch.empty(B, H, latent_dim, dtype=q.dtype, device=q.device)
    for b in range(B):
        rows = gather_pages(cache, page_table, b, int(lengths[b])).float()
        qb = q[b].float().unsqueeze(0)  # [1, H, R+P]
        out[b] = mla_attention_absorbed(qb[..., :latent_dim], qb[..., latent_dim:], rows, identity_kv_b,
                                        latent_dim, scale)[0].to(q.dtype)
    return out
