"""Latent-MoE routed-expert decode with MXFP4 weights on the H200 (GPU only)."""

from __future__ import annotations

from functools import partial

import torch

from k3core.quant.mxfp4 import BLOCK, dequantize, quantize
from kernels.moe import latent_moe_decode_triton, naive
from kernels.perf.harness import Row, rel_err, time_ms

E, L, F, TOP_K = 256, 2048, 1024, 16
VARIANTS = ((16, 1024, 4, 2),)  # rows, cols, warps, row blocks per program


def _experts(dev: str = "cuda"):
    # Quantise in chunks of experts: the float32 copy of all of them at once would be large.
    packs = []
    for rows, cols in ((2 * F, L), (L, F)):
        parts = [quantize(torch.randn(16, rows, cols, device=dev) * cols**-0.5) for _ in range(E // 16)]
        packs += [torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])]
    return packs


def expert_bytes(ids: torch.Tensor) -> float:
    per_expert = 2 * F * L // 2 + 2 * F * L // BLOCK + L * F // 2 + L * F // BLOCK
    return float(ids.unique().numel() * per_expert)


def _torch_peer(x, ids, weights, packs):
    """Plain torch: dequantise every selected expert to bf16, then batched matvecs."""
    gu_p, gu_s, d_p, d_s = packs
    flat = ids.reshape(-1).long()
    w_gu = dequantize(gu_p[flat], gu_s[flat])  # [T*k, 2F, l] bf16
    xs = x.repeat_interleave(ids.shape[1], dim=0).unsqueeze(-1)
    gate_up = torch.bmm(w_gu, xs).squeeze(-1).float()
    h = naive.situ_glu_fused(gate_up).to(x.dtype)
    y = torch.bmm(dequantize(d_p[flat], d_s[flat]), h.unsqueeze(-1)).squeeze(-1).float()
    return (y.reshape(*ids.shape, L) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def moe_rows(batches: tuple[int, ...] = (1, 4, 16), variants: tuple = VARIANTS) -> list[Row]:
    rows: list[Row] = []
    packs = _experts()
    for T in batches:
        x = torch.randn(T, L, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOP_K] for _ in range(T)]).int()
        weights = torch.rand(T, TOP_K, device="cuda")
        # Two tokens share an expert in every batch > 1, so the expert-centric sharing is always checked.
        if T > 1:
            ids[1, 0] = ids[0, 0]
        ref = naive.latent_moe_decode(x, ids, weights, *packs)
        shape = f"T={T},E={E},k={TOP_K},l={L},F={F},mxfp4"
        for br, bc, nw, rb in variants:
            tuning = {"block_rows": br, "block_cols": bc, "num_warps": nw, "row_blocks": rb}
            err = rel_err(latent_moe_decode_triton.latent_moe_decode(x, ids, weights, *packs, **tuning), ref)
            ms, how = time_ms(partial(latent_moe_decode_triton.latent_moe_decode, x, ids, weights, *packs,
                                      **tuning))
            rows.append(Row("latent_moe_decode", shape, f"ours(rows={br}x{rb},cols={bc},w={nw})", ms, expert_bytes(ids),
                            note=how, extra={"rel_err_vs_reference": err}))
        ms, how = time_ms(partial(_torch_peer, x, ids, weights, packs), inner=5, reps=10)
        rows.append(Row("latent_moe_decode", shape, "torch dequantize+bmm", ms, expert_bytes(ids), note=how))
    return rows
