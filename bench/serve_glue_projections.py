"""bench.serve_glue's cases for the decode projections (`--groups skinny`, `floor`): every distinct projection
of the model (`fast_decoder.distinct_projections`) in the skinny GEMM's tilings against cuBLAS as the fast
path calls it, and the copy of each residual-add GEMM's weight, the floor a GEMM of that size is up against.
Weights are cycled through enough copies that every timed call reads them from HBM."""

from __future__ import annotations

import torch

from bench.serve_glue_gemms import WEIGHT_COPIES, Case, each_call, weight_copies
from k3core.config import K3Config
from kernels.fused import naive, skinny_gemm_triton
from services.engine.fast_decoder import distinct_projections


def cold_weights(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of an [n, k] bf16 weight to cycle through: ~200 MB (3 to 24 copies), so that every call of a
    timed graph reads its weight from HBM, not from the 50 MB L2."""
    return weight_copies((n, k), gen, max(WEIGHT_COPIES, min(24, -(-200_000_000 // (n * k * 2)))))


def skinny_cases(c: K3Config, tokens: int, gen: torch.Generator, sweep: bool) -> dict[str, Case]:
    """Each decode projection of the model (`fast_decoder.distinct_projections`) in the skinny GEMM's
    tilings, against cuBLAS as the fast path calls it (F.linear, or addmm_ into the residual). Enough weight
    copies that every call of a timed graph reads its weight from HBM."""
    found: dict[str, Case] = {}
    for name, (n, k, residual) in distinct_projections(c).items():
        x = torch.randn(tokens, k, device=gen.device, generator=gen).to(torch.bfloat16)
        res = torch.randn(tokens, n, device=gen.device, generator=gen).to(torch.bfloat16) if residual else None
        weights = cold_weights(n, k, gen)
        tilings = skinny_gemm_triton.candidate_tilings(n, k)[: None if sweep else 1]
        for t in tilings:
            mine, peer = (None, None) if res is None else (res.clone(), res.clone())
            found[f"skinny {name} n{t.block_n} k{t.block_k} s{t.splits} w{t.num_warps} st{t.num_stages}"] = (
                each_call(lambda w, x=x, r=mine, t=t: skinny_gemm_triton.skinny_gemm(x, w, r, t), weights),
                each_call(lambda w, x=x, r=peer: naive.skinny_linear(x, w, r), weights), n * k * 2)
    return found


def read_floor_cases(c: K3Config, gen: torch.Generator) -> dict[str, Case]:
    """What one launch that only moves a residual-add GEMM's weight takes (HBM-cold, as skinny_cases): a copy
    into a second buffer (read + write counted), the floor a GEMM of that size is up against, launch and tail
    included (a float32 sum was timed too in session 8: its reduction is slower than the copy, no floor)."""
    found: dict[str, Case] = {}
    for n, k, residual in dict.fromkeys(distinct_projections(c).values()):
        if not residual:
            continue
        weights = cold_weights(n, k, gen)
        target = torch.empty_like(weights[0])
        found[f"floor copy {n}x{k}"] = (each_call(target.copy_, weights), None, 2 * n * k * 2)
    return found
