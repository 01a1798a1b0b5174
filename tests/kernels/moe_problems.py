"""The routed-expert decode problem the MoE kernel tests share: random MXFP4 experts, bf16 tokens, routing in
which token 1 names token 0's first expert (two tokens sharing an expert), router weights."""

from __future__ import annotations

import torch

from k3core.quant.mxfp4 import quantize


def expert_packs(experts: int, latent: int, width: int, gen: torch.Generator, device: str = "cpu") -> tuple:
    """Canonical MXFP4 packs of W_gate;W_up [E, 2F, l] and W_down [E, l, F], scaled to unit-variance outputs."""
    return (*quantize(torch.randn(experts, 2 * width, latent, generator=gen, device=device) * latent**-0.5),
            *quantize(torch.randn(experts, latent, width, generator=gen, device=device) * width**-0.5))


def moe_problem(tokens: int, experts: int, top_k: int, latent: int, width: int, device: str, seed: int) -> tuple:
    """(packs, x bf16 [T, l], ids int32 [T, k], router weights [T, k]); top_k >= 2."""
    gen = torch.Generator(device=device).manual_seed(seed)
    packs = expert_packs(experts, latent, width, gen, device)
    x = torch.randn(tokens, latent, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)]).int()
    if tokens > 1 and not (ids[1] == ids[0, 0]).any():
        ids[1, 1] = ids[0, 0]
    return packs, x, ids, torch.rand(tokens, top_k, generator=gen, device=device)
