"""Plain-torch references of the MoE kernels, composed from k3core.ops.moe and k3core.quant.mxfp4."""

from __future__ import annotations

import torch

from k3core.ops.moe import situ_glu
from k3core.quant.mxfp4 import dequantize
from kernels.moe.tiles import Tile

F32 = torch.float32


def latent_moe_decode(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scales: torch.Tensor, down_packed: torch.Tensor,
    down_scales: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, gate_up_tile: Tile | None = None,
    down_tile: Tile | None = None, token_block: int = 16, h_parts: int | None = None,
) -> torch.Tensor:
    """Reference of kernels.moe.latent_moe_decode_triton.latent_moe_decode (tuning ignored): dequantise
    each selected expert, gate/up matvec, SiTU-GLU, down matvec, weighted sum; float32 throughout."""
    del gate_up_tile, down_tile, token_block, h_parts
    out = torch.zeros(x.shape, dtype=F32, device=x.device)
    F = gate_up_packed.shape[1] // 2
    for t in range(x.shape[0]):
        for e, p in zip(expert_ids[t].tolist(), expert_weights[t].to(F32), strict=True):
            w_gu = dequantize(gate_up_packed[e], gate_up_scales[e], F32)  # [2F, l]
            gate_up = w_gu @ x[t].to(F32)
            h = situ_glu(gate_up[:F], gate_up[F:], beta1, beta2)
            out[t] += p * (dequantize(down_packed[e], down_scales[e], F32) @ h)
    return out.to(x.dtype)


def situ_glu_fused(gate_up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, block: int = 1024,
                   num_warps: int = 4) -> torch.Tensor:
    """Reference of kernels.moe.situ_glu_triton.situ_glu_fused: [..., 2F] (gate | up) -> [..., F] (tuning
    ignored)."""
    del block, num_warps
    F = gate_up.shape[-1] // 2
    return situ_glu(gate_up[..., :F], gate_up[..., F:], beta1, beta2)
