"""One decoder layer: attention (KDA or Gated MLA) and its feed-forward (dense MLP or MoE).

The residual wiring lives in the backbone (plain residual or Block AttnRes); a layer only offers its
two pre-normed sublayers and, under AttnRes, the two sites that compute their inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.cache.interface import BatchCache
from k3core.config import K3Config
from k3core.layers.attnres import AttnResSite
from k3core.layers.batch import BatchLayout
from k3core.layers.kda import KimiDeltaAttention
from k3core.layers.mla import GatedMLA
from k3core.layers.mlp import GatedMLP, glu_for
from k3core.layers.moe import SparseMoE
from k3core.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_kind(layer) == "kda":
            self.self_attn: nn.Module = KimiDeltaAttention(config, config.kda_index(layer))
        else:
            self.self_attn = GatedMLA(config, config.mla_index(layer))
        self.is_moe = config.is_moe_layer(layer)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, glu_for(config))
        if config.uses_attn_res:
            self.attn_res = nn.ModuleDict(
                {site: AttnResSite(config.hidden_size, config.rms_norm_eps) for site in ("attn", "mlp")}
            )

    def attention(self, h: torch.Tensor, layout: BatchLayout, cache: BatchCache) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), layout, cache)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return ffn(self.post_attention_layernorm(h))
