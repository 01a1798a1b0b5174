"""Gated MLA layer with NoPE (K3 report eq.7), Kimi Linear / DeepSeek tensor names.

The cache gets one latent row per token ([kv_a_layernorm(c_kv) | k_pe]); prefill chunks attend with
expanded keys, decode steps with the weight-absorbed form. K3 adds the full-rank output gate `g_proj`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from k3core.cache.interface import BatchCache
from k3core.config import K3Config
from k3core.layers.batch import BatchLayout
from k3core.layers.norm import RMSNorm
from k3core.ops.mla import causal_mask, mla_attention_absorbed, mla_attention_naive, sigmoid_output_gate

PAD_VALUES_FOR_FLASH = True  # False: the memory-efficient kernel of unpadded values (bench.serve_ttft's --before)


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config, mla_index: int) -> None:
        super().__init__()
        self.mla_index = mla_index
        self.heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.scale = 1.0 / math.sqrt(self.nope + self.rope)
        dim, q_width = config.hidden_size, self.heads * (self.nope + self.rope)
        self.q_lora = config.q_lora_rank is not None
        if config.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(dim, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(dim, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.output_gate = config.mla_use_output_gate
        if self.output_gate:
            self.g_proj = nn.Linear(dim, self.heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, dim, bias=False)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cache rows of tokens x [N, hidden] -> [N, kv_lora_rank + qk_rope_head_dim]."""
        kv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(kv[:, : self.rank]), kv[:, self.rank :]], dim=-1)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head queries of tokens x [N, hidden] -> [N, heads, qk_nope_head_dim + qk_rope_head_dim]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q.reshape(x.shape[0], self.heads, self.nope + self.rope)

    def _prefill_fused(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """Expanded-key attention of T queries (the last T of S positions) in one fused SDPA call: the
        GPU prefill path, which never materialises the [H, T, S] scores (long prompts)."""
        kv = F.linear(latent[:, : self.rank], self.kv_b_proj.weight).view(latent.shape[0], self.heads, -1)
        k_pe = latent[:, None, self.rank :].expand(-1, self.heads, -1)
        keys = torch.cat([kv[..., : self.nope], k_pe], dim=-1).transpose(0, 1)
        values = kv[..., self.nope :]
        if PAD_VALUES_FOR_FLASH and q.dtype in (torch.float16, torch.bfloat16):
            # SDPA's flash kernel takes one head dim for q, k and v (else the memory-efficient one runs): the
            # values' zero columns add nothing to the output and cost 20 % more FLOPs, against 1.7-1.9x the
            # speed at 8K x 32K and 4K x 135K on the H200 (session 6, .device exploration in docs/serving.md)
            values = F.pad(values, (0, keys.shape[-1] - self.v_dim))
        mask = causal_lower_right(q.shape[0], latent.shape[0])
        # 4-D (a batch of one): SDPA's fused kernels take only 4-D inputs. A 3-D call fell back to the math
        # path, which materialises the mask and float32 scores [H, T, S] (17 GB at T=8K, S=32K on mini).
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values.transpose(0, 1)[None],
                                           attn_mask=mask, scale=self.scale)
        return o[0, ..., : self.v_dim].transpose(0, 1)

    def forward(self, x: torch.Tensor, layout: BatchLayout, cache: BatchCache) -> torch.Tensor:
        q = self.queries(x)
        cache.mla_append(self.mla_index, self.latent(x))
        outs = []
        for seq, (start, end) in enumerate(layout.token_ranges):
            latent = cache.mla_read(self.mla_index, seq).to(x.dtype)
            # One query (decode) is the last position and sees every key: absorbed form, no mask to build.
            single = end - start == 1
            if not single and x.is_cuda:
                outs.append(self._prefill_fused(q[start:end], latent))
                continue
            attend = mla_attention_absorbed if single else mla_attention_naive
            mask = None if single else causal_mask(end - start, latent.shape[0], x.device)
            q_seq = q[start:end]
            outs.append(
                attend(q_seq[..., : self.nope], q_seq[..., self.nope :], latent, self.kv_b_proj.weight,
                       self.v_dim, self.scale, mask)
            )  # fmt: skip
        o = torch.cat(outs)
        if self.output_gate:
            o = sigmoid_output_gate(o, self.g_proj(x).reshape(o.shape))
        return self.o_proj(o.reshape(x.shape[0], -1))
