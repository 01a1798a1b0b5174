"""Kimi Delta Attention layer (K3 report eq.1-6), Kimi Linear tensor names.

K3 form: bounded gate (eq.5) and a full-rank output gate `g_proj`; Kimi Linear form: softplus gate and
the low-rank `g_a_proj`/`g_b_proj`. Prefill chunks use the chunkwise path (on CUDA with the bounded gate
in a validated dtype and head dim, outside autograd: the fused Triton block,
k3core/layers/kda_prefill_fast.py), decode steps the single-step path; both read and write the conv and
recurrent states through the BatchCache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3core.cache.interface import BatchCache
from k3core.config import K3Config
from k3core.layers.batch import BatchLayout
from k3core.layers.kda_prefill_fast import kda_prefill_triton, triton_prefill_applies
from k3core.layers.norm import RMSNorm
from k3core.layers.weight_derivation import WeightDerivation
from k3core.ops.kda import (
    causal_short_conv,
    kda_chunk,
    kda_gate_bounded,
    kda_gate_softplus,
    kda_step,
    l2norm,
    short_conv_step,
)
from k3core.ops.norm import gated_rms_norm


def _depthwise_conv(channels: int, width: int) -> nn.Conv1d:
    """Weight [C, 1, W], the layout of the checkpoints' q/k/v_conv1d.weight."""
    return nn.Conv1d(channels, channels, width, groups=channels, bias=False)


def _stack_conv_kernels(weights: list[torch.Tensor]) -> torch.Tensor:
    """Three [C, 1, W] depthwise conv weights -> [3, C, W]."""
    return torch.stack([w[:, 0, :] for w in weights])


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, kda_index: int) -> None:
        super().__init__()
        self.kda_index = kda_index
        self.heads, self.head_dim = config.kda_num_heads, config.kda_head_dim
        self.kernel = config.short_conv_kernel_size
        self.lower_bound = config.gate_lower_bound
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.head_dim)
        dim, proj = config.hidden_size, config.kda_projection_size
        self.q_proj = nn.Linear(dim, proj, bias=False)
        self.k_proj = nn.Linear(dim, proj, bias=False)
        self.v_proj = nn.Linear(dim, proj, bias=False)
        self.q_conv1d = _depthwise_conv(proj, self.kernel)
        self.k_conv1d = _depthwise_conv(proj, self.kernel)
        self.v_conv1d = _depthwise_conv(proj, self.kernel)
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))  # released shape; kept float32
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.f_a_proj = nn.Linear(dim, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.b_proj = nn.Linear(dim, self.heads, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(dim, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(dim, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.o_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, dim, bias=False)
        self.full_rank_gate = config.use_full_rank_gate
        self._stacked_conv = WeightDerivation(_stack_conv_kernels)

    def stacked_conv_weight(self) -> torch.Tensor:
        """[3, H*D, W]: the q/k/v depthwise conv kernels in one tensor, the layout the fused KDA kernels take;
        built again only after a conv weight changed (or under autograd: see WeightDerivation)."""
        return self._stacked_conv.get([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], self.heads, self.head_dim)

    def _conv(
        self, inputs: list[torch.Tensor], conv_state: torch.Tensor, layout: BatchLayout
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """ShortConv + SiLU of q, k, v; conv_state [B, 3, H, D, W-1] -> outputs and the new state."""
        batch = layout.num_sequences
        outs, states = [], []
        for i, (x, conv) in enumerate(
            zip(inputs, (self.q_conv1d, self.k_conv1d, self.v_conv1d), strict=True)
        ):
            weight = conv.weight[:, 0, :]
            state = conv_state[:, i].reshape(batch, -1, self.kernel - 1).to(x.dtype)
            if layout.is_decode:
                y, new = short_conv_step(x, state, weight, None, "silu")
            else:
                y, new = causal_short_conv(x[None], weight, None, "silu", state, layout.cu_seqlens(x.device))
                y = y[0]
            outs.append(y)
            states.append(new.reshape(batch, self.heads, self.head_dim, self.kernel - 1))
        return outs, torch.stack(states, dim=1)

    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        z = self._heads(self.f_b_proj(self.f_a_proj(x)))
        a_log = self.A_log.reshape(self.heads)
        if self.lower_bound is not None:
            return kda_gate_bounded(z, a_log, self.lower_bound, self.dt_bias)
        return kda_gate_softplus(z, a_log, self.dt_bias)

    def forward(self, x: torch.Tensor, layout: BatchLayout, cache: BatchCache) -> torch.Tensor:
        """x [N, hidden] (N = packed new tokens) -> [N, hidden]."""
        conv_state, recurrent = cache.kda_read(self.kda_index)
        if not layout.is_decode and triton_prefill_applies(self, x):
            o, new_conv, new_recurrent = kda_prefill_triton(self, x, layout, conv_state, recurrent)
            cache.kda_write(self.kda_index, new_conv, new_recurrent)
            return self.o_proj(o)
        (q, k, v), new_conv = self._conv([self.q_proj(x), self.k_proj(x), self.v_proj(x)], conv_state, layout)
        q, k, v = l2norm(self._heads(q)), l2norm(self._heads(k)), self._heads(v)
        g = self._decay(x)
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))
        if layout.is_decode:
            o, new_state = kda_step(q, k, v, g, beta, recurrent, self.scale)
        else:
            parts = (t.unsqueeze(0) for t in (q, k, v, g, beta))
            o, new_state = kda_chunk(
                *parts, scale=self.scale, initial_state=recurrent, cu_seqlens=layout.cu_seqlens(x.device)
            )
            o = o[0]
        cache.kda_write(self.kda_index, new_conv.to(conv_state.dtype), new_state.to(recurrent.dtype))
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_rms_norm(o, self._heads(gate), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(x.shape[0], -1))
