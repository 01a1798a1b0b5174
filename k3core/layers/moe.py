"""Stable LatentMoE layer (K3 report eq.11-13): shared experts at full width, routed experts in a latent
width behind routed_expert_down_proj, RMSNorm on the aggregate, routed_expert_up_proj back; the sigmoid
router's e_score_correction_bias (the frozen QB bias) only selects experts. Without a latent width this
is the Kimi Linear MoE."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k3core.config import K3Config
from k3core.layers.mlp import Expert, GatedMLP, glu_for
from k3core.layers.norm import RMSNorm
from k3core.ops.moe import sigmoid_router


class MoEGate(nn.Module):
    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [N, E] in float32 (routing decisions should not depend on the model dtype)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        return x.to(dtype) @ self.weight.to(dtype).T


class SparseMoE(nn.Module):
    def __init__(self, config: K3Config) -> None:
        super().__init__()
        glu = glu_for(config)
        width = config.routed_width
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.gate = MoEGate(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(
            Expert(width, config.moe_intermediate_size, glu) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, glu)
            if config.num_shared_experts
            else None
        )
        self.latent = config.uses_latent_moe
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, config.hidden_size, bias=False)
            self.routed_expert_norm = (
                RMSNorm(width, config.rms_norm_eps) if config.latent_moe_use_norm else None
            )
        # While set, `forward` runs this instead: the same layer in a faster form that the serving engine
        # provides (its sync-free grouped MoE, services.engine.model_runner). The loop below syncs with the
        # device once per expert, which dominates a short prefill chunk on a GPU.
        self.fast_form: Callable[[torch.Tensor], torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k], unbiased sigmoid scores [N, E]); the scores feed QB updates
        of `gate.e_score_correction_bias` (k3core.ops.qb) during training."""
        logits = self.gate(x)
        weights, indices = sigmoid_router(
            logits, self.top_k, self.gate.e_score_correction_bias, self.renormalize, self.scaling
        )
        return weights, indices, torch.sigmoid(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_form is not None:
            return self.fast_form(x)
        weights, indices, _ = self.route(x)
        z = self.routed_expert_down_proj(x) if self.latent else x
        routed = torch.zeros(z.shape, dtype=weights.dtype, device=z.device)
        for expert_id in indices.unique().tolist():
            token_ids, slot = (indices == expert_id).nonzero(as_tuple=True)
            out = self.experts[expert_id](z[token_ids])
            routed.index_add_(0, token_ids, out.to(weights.dtype) * weights[token_ids, slot].unsqueeze(-1))
        routed = routed.to(x.dtype)
        if self.latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed
