"""K3Model: embedding, hybrid KDA / Gated MLA decoder layers, Block AttnRes (or a plain residual), LM head.

One `forward` serves prefill chunks and batched decode: the tokens of B sequences are packed in batch order
and every cache access goes through a BatchCache. `prefill` and `decode` are the convenience entry points
over contiguous per-sequence caches.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.cache.contiguous import ContiguousBatchCache, SequenceCache
from k3core.cache.interface import BatchCache
from k3core.config import K3Config
from k3core.layers.attnres import AttnResSite, AttnResStream
from k3core.layers.batch import BatchLayout
from k3core.layers.decoder import DecoderLayer
from k3core.layers.norm import RMSNorm


class K3Backbone(nn.Module):
    """Named `model` inside K3Model, as in the checkpoints (`model.embed_tokens`, `model.layers.N`, ...)."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.uses_attn_res:
            self.attn_res_final = AttnResSite(config.hidden_size, config.rms_norm_eps)


class K3Model(nn.Module):
    def __init__(self, config: K3Config, attn_res_two_phase: bool = True) -> None:
        super().__init__()
        self.config = config
        self.attn_res_two_phase = attn_res_two_phase
        self.model = K3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_sequence_cache(self, state_dtype: torch.dtype = torch.float32) -> SequenceCache:
        weight = self.model.embed_tokens.weight
        return SequenceCache(self.config, weight.dtype, state_dtype, weight.device)

    def _check_tokens(self, tokens: torch.Tensor, expected: int) -> None:
        if tokens.dim() != 1 or tokens.shape[0] != expected:
            raise ValueError(
                f"tokens must be a 1-D tensor of {expected} ids, got shape {tuple(tokens.shape)}"
            )
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        if expected and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got {tokens.min()}..{tokens.max()}"
            )

    def _layers_attn_res(self, h: torch.Tensor, layout: BatchLayout, cache: BatchCache) -> torch.Tensor:
        layers, size = self.model.layers, self.config.attn_res_block_size
        assert size is not None
        stream = AttnResStream(h, self.config.rms_norm_eps, self.attn_res_two_phase)
        for i, layer in enumerate(layers):
            if i % size == 0:
                block = layers[i : i + size]
                stream.begin_block(
                    [site for lay in block for site in (lay.attn_res["attn"], lay.attn_res["mlp"])]
                )
            stream.add(layer.attention(stream.input_for(layer.attn_res["attn"]), layout, cache))
            stream.add(layer.feed_forward(stream.input_for(layer.attn_res["mlp"])))
            if (i + 1) % size == 0:
                stream.end_block()
        return stream.final(self.model.attn_res_final)

    def _layers_residual(self, h: torch.Tensor, layout: BatchLayout, cache: BatchCache) -> torch.Tensor:
        for layer in self.model.layers:
            h = h + layer.attention(h, layout, cache)
            h = h + layer.feed_forward(h)
        return h

    def forward(self, tokens: torch.Tensor, cache: BatchCache, logits_for: str = "all") -> torch.Tensor:
        """tokens [sum(new_token_counts)] packed in batch order -> logits [N, V] ("all") or [B, V] ("last")."""
        if logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all' or 'last', got {logits_for!r}")
        layout = BatchLayout.of(cache.context_lens, cache.new_token_counts)
        self._check_tokens(tokens, layout.num_tokens)
        h = self.model.embed_tokens(tokens)
        if self.config.uses_attn_res:
            h = self._layers_attn_res(h, layout, cache)
        else:
            h = self._layers_residual(h, layout, cache)
        if logits_for == "last":
            h = h[layout.last_token_indices()]
        return self.lm_head(self.model.norm(h))

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: SequenceCache, start: int) -> torch.Tensor:
        """Run tokens [T] at positions start..start+T-1 of one sequence; resumable at any split point.

        `start` must equal the tokens already in `cache`. Returns logits [T, V]; the cache advances by T.
        """
        if start != cache.length:
            raise ValueError(f"prefill start={start} but the cache holds {cache.length} tokens")
        batch = ContiguousBatchCache([cache], [tokens.shape[0]])
        logits = self(tokens, batch)
        batch.commit()
        return logits

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: list[SequenceCache] | BatchCache) -> torch.Tensor:
        """One new token per sequence: tokens [B] -> logits [B, V]; contiguous caches advance by one."""
        batch = ContiguousBatchCache(cache, [1] * len(cache)) if isinstance(cache, list) else cache
        if any(n != 1 for n in batch.new_token_counts):
            raise ValueError(f"decode takes one token per sequence, got counts {batch.new_token_counts}")
        logits = self(tokens, batch)
        if isinstance(batch, ContiguousBatchCache):
            batch.commit()
        return logits
