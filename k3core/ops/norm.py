"""RMSNorm and the gated RMSNorm of the KDA output (K3 report eq.6)."""

from __future__ import annotations

import torch

from k3core.ops._common import acc_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32+, returned in x's dtype."""
    dtype = acc_dtype(x)
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    return y.to(x.dtype)


def gated_rms_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> torch.Tensor:
    """eq.6 inner part: RMSNorm(o) * sigmoid(gate), per head (o and gate [..., H, V], weight [V])."""
    dtype = acc_dtype(o, gate)
    normed = rms_norm(o.to(dtype), weight, eps)
    return (normed * torch.sigmoid(gate.to(dtype))).to(o.dtype)
