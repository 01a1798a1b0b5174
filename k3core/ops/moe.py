"""Stable LatentMoE math (K3 report §2.3, eq.11-13, appendix B): activations and the sigmoid router.

Quantile Balancing (eq.14, appendices C-D), which only moves the router bias, lives in k3core.ops.qb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops._common import acc_dtype


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """eq.12: [beta1 tanh(gate/beta1) * sigmoid(gate)] * [beta2 tanh(up/beta2)].

    Both factors are bounded, so |output| < beta1 * beta2 (eq.19); near 0 it matches SwiGLU to first
    order (eq.18). Computed in float32+ and cast back, as the released implementation does.
    """
    if beta1 <= 0 or beta2 <= 0:
        raise ValueError(f"SiTU betas must be positive, got {beta1}, {beta2}")
    dtype = acc_dtype(gate, up)
    g, u = gate.to(dtype), up.to(dtype)
    out = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, the Kimi Linear / DeepSeek expert activation."""
    dtype = acc_dtype(gate, up)
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


def sigmoid_router(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """eq.13: s = sigmoid(W_r x); experts = argtop_k(s + b); weights from s alone.

    logits [T, E] -> (weights [T, k] float32+, indices [T, k]). The bias only selects: it never enters
    the weights, which are s over the chosen experts, renormalised to sum 1 when `renormalize`, then
    multiplied by `scaling` (Kimi Linear's routed_scaling_factor).
    """
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    scores = torch.sigmoid(logits.to(acc_dtype(logits)))
    selection = scores if bias is None else scores + bias.to(scores.dtype)
    indices = selection.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scaling, indices
