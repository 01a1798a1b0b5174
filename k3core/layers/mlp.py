"""Gated MLPs: the dense layers, the shared experts and the routed experts (SiTU-GLU or SwiGLU)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from k3core.config import K3Config
from k3core.ops.moe import situ_glu, swiglu

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def glu_for(config: K3Config) -> GLU:
    if config.hidden_act == "situ":
        return partial(situ_glu, beta1=config.situ_beta, beta2=config.situ_linear_beta)
    return swiglu


class GatedMLP(nn.Module):
    """down_proj(glu(gate_proj x, up_proj x)): dense layers (`mlp`) and fused shared experts."""

    def __init__(self, dim: int, intermediate: int, glu: GLU) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """A routed expert with the checkpoint's w1 (gate), w3 (up), w2 (down) names."""

    def __init__(self, dim: int, intermediate: int, glu: GLU) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate, bias=False)
        self.w3 = nn.Linear(dim, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, dim, bias=False)
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.glu(self.w1(x), self.w3(x)))
