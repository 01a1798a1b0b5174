"""A synthetic model and its oracle for cache tests.

The "model" drives the real `BatchCache` protocol: per KDA layer it reads the state, folds each new token
into it with an exact integer recurrence (values stay integers below 2**24, exact in float32 and, for the
conv tail and the latents, below 256 so exact in bfloat16), writes it back; per MLA layer it appends one
latent per token derived from the layer-0 state after that token, and reads all latents back into the
output. Restoring a wrong state or wrong MLA rows changes every later value, so byte equality with the
oracle (the same recurrence run from scratch on the token prefix) certifies the cache.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from k3core.cache.layout import CacheShape, PoolLayout, plan_layout

MOD = 65521
SHAPE = CacheShape("synthetic", num_kda_layers=4, num_mla_layers=2, kda_heads=2, kda_head_dim=4, conv_kernel=4,
                   mla_latent_dim=64)
VOCAB = 200


def tiny_layout(hash_block: int = 4, tokens_per_block: int = 12) -> PoolLayout:
    lay = plan_layout(SHAPE, 1, hash_block_tokens=hash_block, min_tokens_per_block=tokens_per_block,
                      layers_per_group=2)
    assert lay.tokens_per_block == tokens_per_block, lay
    return lay


def _step(rec: torch.Tensor, conv: torch.Tensor, token: int, layer: int) -> None:
    weights = torch.arange(1, rec.numel() + 1, dtype=rec.dtype).view_as(rec)
    rec.mul_(3).add_(token * weights + layer).remainder_(MOD)
    conv.copy_(torch.roll(conv, -1, dims=-1))
    conv[..., -1] = token


def latent_of(rec_layer0: torch.Tensor, mla_layer: int) -> torch.Tensor:
    flat = rec_layer0.flatten().repeat(-(-SHAPE.mla_latent_dim // rec_layer0.numel()))
    return (flat[: SHAPE.mla_latent_dim].remainder(251) + mla_layer).to(torch.bfloat16)


def forward(cache, new_tokens: list[list[int]]) -> list[float]:
    """Run the synthetic model over one varlen batch; returns one output value per sequence."""
    latents: list[list[torch.Tensor]] = [[] for _ in new_tokens]
    for layer in range(SHAPE.num_kda_layers):
        conv, rec = cache.kda_read(layer)
        for b, tokens in enumerate(new_tokens):
            for token in tokens:
                _step(rec[b], conv[b], token, layer)
                if layer == 0:
                    latents[b].append(rec[b].clone())
        cache.kda_write(layer, conv, rec)
    outputs = [0.0] * len(new_tokens)
    for m in range(SHAPE.num_mla_layers):
        rows = [latent_of(state, m) for seq in latents for state in seq]
        cache.mla_append(m, torch.stack(rows))
        for b in range(len(new_tokens)):
            outputs[b] += float(cache.mla_read(m, b).double().sum())
    for layer in range(SHAPE.num_kda_layers):
        outputs = [o + float(s.double().sum()) for o, s in zip(outputs, cache.kda_read(layer)[1], strict=True)]
    return outputs


@lru_cache(maxsize=65536)
def _state_after(tokens: tuple[int, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(conv per KDA layer, recurrent per KDA layer) after `tokens`, built on the memoised shorter prefix."""
    h, d, w = SHAPE.kda_heads, SHAPE.kda_head_dim, SHAPE.conv_kernel
    if not tokens:
        convs = tuple(torch.zeros(3, h, d, w - 1, dtype=torch.bfloat16) for _ in range(SHAPE.num_kda_layers))
        return convs, tuple(torch.zeros(h, d, d) for _ in range(SHAPE.num_kda_layers))
    convs, recs = (tuple(t.clone() for t in part) for part in _state_after(tokens[:-1]))
    for layer in range(SHAPE.num_kda_layers):
        _step(recs[layer], convs[layer], tokens[-1], layer)
    return convs, recs


def reference(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(conv per KDA layer, recurrent per KDA layer, latents [len, dim] per MLA layer) after `tokens`."""
    convs, recs = _state_after(tuple(tokens))
    rows = [[latent_of(_state_after(tuple(tokens[: i + 1]))[1][0], m) for i in range(len(tokens))]
            for m in range(SHAPE.num_mla_layers)]
    empty = torch.zeros(0, SHAPE.mla_latent_dim, dtype=torch.bfloat16)
    return list(convs), list(recs), [torch.stack(r) if r else empty for r in rows]
