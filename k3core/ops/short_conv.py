"""Causal depthwise short convolution (the ShortConv of KDA, eq.2) with a carried state for resumption.

The state of a sequence is its last W-1 pre-convolution inputs, channel-major [C, W-1] (zeros at the
start of a sequence), so a prefill can be cut anywhere and resumed, and decode is one window per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops._common import acc_dtype, check_initial_state, sequence_bounds, start_state

_ACTIVATIONS = (None, "silu", "swish")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    return F.silu(y) if activation is not None else y


def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t, c] = act(sum_w weight[c, w] * x[t - (W-1) + w, c] + bias[c]) per sequence.

    x: [B, T, C]; weight: [C, W]; initial_state: [N, C, W-1] or None (zeros); cu_seqlens: [N+1] with B == 1.
    Returns (y [B, T, C] in x's dtype, final_state [N, C, W-1] in x's dtype): the last W-1 inputs, taken
    from the initial state where a sequence is shorter than W-1.
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"need x [B,T,C] and weight [C,W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    batch, length, channels = x.shape
    width = weight.shape[1]
    seqs = sequence_bounds(cu_seqlens, batch, length)
    check_initial_state(initial_state, len(seqs), "initial_state")
    dtype = acc_dtype(x, weight)
    w = weight.to(dtype).unsqueeze(1)  # [C, 1, W] depthwise kernel
    b = bias.to(dtype) if bias is not None else None
    y = torch.empty_like(x)
    finals = []
    for n, (row, start, end) in enumerate(seqs):
        history = start_state(initial_state, n, (channels, width - 1), dtype, x)
        seq = x[row, start:end].to(dtype).transpose(0, 1)  # [C, t]
        padded = torch.cat([history, seq], dim=1)  # [C, W-1+t]
        out = F.conv1d(padded.unsqueeze(0), w, b, groups=channels)[0]  # [C, t]
        y[row, start:end] = _activate(out, activation).transpose(0, 1).to(x.dtype)
        finals.append(padded[:, padded.shape[1] - (width - 1) :])
    return y, torch.stack(finals).to(x.dtype)


def short_conv_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token: x [B, C], conv_state [B, C, W-1] -> (y [B, C], new_state [B, C, W-1])."""
    dtype = acc_dtype(x, weight)
    window = torch.cat([conv_state.to(dtype), x.to(dtype).unsqueeze(-1)], dim=-1)  # [B, C, W]
    out = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(dtype)
    return _activate(out, activation).to(x.dtype), window[..., 1:].to(conv_state.dtype)
