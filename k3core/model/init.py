"""Deterministic random weights for presets without a checkpoint (tests, benchmarks)."""

from __future__ import annotations

import math

import torch

from k3core.model.k3model import K3Model


@torch.no_grad()
def init_weights(model: K3Model, seed: int = 0) -> K3Model:
    """Seeded init with unit-scale activations, so a random model's logits are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    bounded = model.config.gate_lower_bound is not None
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):  # RMSNorm weights, layernorm ones included
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif leaf == "A_log":  # K3 initialises A at 0 (§2.1.1); Kimi Linear draws log U(1, 16)
            values = (
                torch.zeros(param.shape)
                if bounded
                else torch.empty(param.shape).uniform_(1, 16, generator=gen).log()
            )
        elif leaf in ("dt_bias", "query"):
            values = torch.randn(param.shape, generator=gen) * (
                1.0 if leaf == "dt_bias" else param.shape[-1] ** -0.5
            )
        elif leaf == "e_score_correction_bias":
            values = 0.05 * torch.randn(param.shape, generator=gen)
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        else:  # linear and conv weights: fan-in scaling
            fan_in = param.shape[-1] if param.dim() == 2 else param.shape[-1] * param.shape[-2]
            values = torch.randn(param.shape, generator=gen) / math.sqrt(fan_in)
        param.copy_(values.to(param.dtype))
    return model
