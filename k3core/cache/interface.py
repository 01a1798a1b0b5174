"""The contract between the model and whatever holds its caches.

The model never owns cache memory. Every forward gets a `BatchCache`: a view of the caches of the B
sequences in the batch (prefill chunks and decode steps alike, varlen). `k3core.cache.contiguous` is the
simple implementation; the paged pool of the decode worker implements the same protocol.

Shapes (per rank; H = KDA heads on this rank, D = KDA head dim, W = short-conv kernel size):
- KDA conv state: [B, 3, H, D, W-1]  the last W-1 pre-conv inputs of q, k, v (zeros at sequence start).
- KDA recurrent state: [B, H, D, D]  float32, S[h] of eq.3 (key dim x value dim).
- MLA latent: [tokens, kv_lora_rank + qk_rope_head_dim]  the normalised latent c_kv and the (unrotated,
  NoPE) shared key part, one row per token.

KDA layers are indexed by their position among KDA layers (0..num_kda_layers-1), MLA layers by their
position among MLA layers, so a cache can size itself from the config alone.

Call order within one forward (what `K3Model.forward` does, and all it assumes): per KDA layer one
`kda_read` then one `kda_write`; per MLA layer one `mla_append` then one `mla_read` per sequence. The
model never advances lengths: the owner does after the forward (`ContiguousBatchCache.commit()`), and may
stage writes until then so that a failed forward leaves every sequence unchanged. States are read and
written in the cache's dtypes; the model computes in at least float32 and casts back.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BatchCache(Protocol):
    @property
    def num_sequences(self) -> int:
        """B: sequences in this forward."""

    @property
    def context_lens(self) -> list[int]:
        """Tokens already cached per sequence before this forward (the start position of its new tokens)."""

    @property
    def new_token_counts(self) -> list[int]:
        """New tokens per sequence in this forward (1 for a decode step)."""

    def kda_read(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_state [B,3,H,D,W-1], recurrent_state [B,H,D,D]) as of each sequence's context_len."""

    def kda_write(self, kda_layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """Store the states after this forward's new tokens."""

    def mla_append(self, mla_layer: int, latent: torch.Tensor) -> None:
        """Append the new tokens' latents, [sum(new_token_counts), latent_dim], sequences in batch order."""

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        """All latents of sequence `seq` after the append: [context_len + new_tokens, latent_dim]."""
