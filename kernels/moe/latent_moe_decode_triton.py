"""Token-centric routed-expert decode with MXFP4 weights streamed and dequantised on the fly (§5.4.2).

At decode batch sizes a grouped GEMM degenerates into streaming weight matrices, so the work is cut by
output neuron, not by tile: program (token-expert pair, row block) walks its expert's packed rows once,
turns e2m1 codes into floats with a few integer operations (code -> fp16 bit pattern, times 2^14: exact
for all eight magnitudes, subnormal 0.5 included), applies the e8m0 scale per 32 elements and reduces.
Kernel 1: gate and up rows -> SiTU-GLU -> h [T*k, F]. Kernel 2: down rows times the router weight
-> [T*k, l], summed over the k experts of a token -> u [T, l]. Weights use k3core.quant.mxfp4's layout:
packed uint8 [E, rows, cols/2] (element 2i in the low nibble), scales uint8 [E, rows, cols/32].
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def _mxfp4_row_dot(packed, scales, rows, row_ok, x, c0, COLS: tl.constexpr, BR: tl.constexpr,
                       BC: tl.constexpr):
        """sum_c W[rows, c0 + c] * x[c0 + c] for BC columns (BC/2 bytes, BC/32 scales per row)."""
        cb = tl.arange(0, BC // 2)
        codes = tl.load(packed + rows[:, None] * (COLS // 2) + (c0 // 2 + cb)[None, :], mask=row_ok[:, None],
                        other=0).to(tl.int16)
        lo = ((codes & 7) << 9) | ((codes & 8) << 12)
        hi = (((codes >> 4) & 7) << 9) | (((codes >> 4) & 8) << 12)
        w_lo = lo.to(tl.float16, bitcast=True).to(tl.float32)
        w_hi = hi.to(tl.float16, bitcast=True).to(tl.float32)
        x_even = tl.load(x + c0 + 2 * cb).to(tl.float32)
        x_odd = tl.load(x + c0 + 2 * cb + 1).to(tl.float32)
        part = w_lo * x_even[None, :] + w_hi * x_odd[None, :]  # [BR, BC/2]
        groups = tl.sum(tl.reshape(part, (BR, BC // 32, 16)), 2)  # [BR, BC/32]
        s = tl.load(scales + rows[:, None] * (COLS // 32) + (c0 // 32 + tl.arange(0, BC // 32))[None, :],
                    mask=row_ok[:, None], other=127).to(tl.float32)
        return tl.sum(groups * tl.exp2(s - 127.0), 1) * 16384.0  # 2^14 undoes the fp16 exponent bias

    @triton.jit
    def _gate_up_situ_kernel(x, ids, wgu, sgu, h, K, F, beta1, beta2, L: tl.constexpr, BR: tl.constexpr,
                             BC: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BR + tl.arange(0, BR)
        ok = rows < F
        e = tl.load(ids + pair).to(tl.int64)
        xt = x + (pair // K) * L
        wg = wgu + e * (2 * F) * (L // 2)
        sg = sgu + e * (2 * F) * (L // 32)
        g = tl.zeros([BR], dtype=tl.float32)
        u = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, L, BC):
            g += _mxfp4_row_dot(wg, sg, rows, ok, xt, c0, L, BR, BC)
            u += _mxfp4_row_dot(wg, sg, rows + F, ok, xt, c0, L, BR, BC)
        tl.store(h + pair * F + rows, situ_glu_values(g, u, beta1, beta2), mask=ok)

    @triton.jit
    def _down_kernel(h, ids, weights, wd, sd, partial, K, F: tl.constexpr, L, BR: tl.constexpr,
                     BC: tl.constexpr):
        """One (token, expert) pair per program row: p * W_down[e][rows] . h[pair] -> partial[pair, rows]."""
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BR + tl.arange(0, BR)
        ok = rows < L
        e = tl.load(ids + pair).to(tl.int64)
        acc = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, F, BC):
            acc += _mxfp4_row_dot(wd + e * L * (F // 2), sd + e * L * (F // 32), rows, ok, h + pair * F, c0, F, BR,
                                  BC)
        tl.store(partial + pair * L + rows, tl.load(weights + pair).to(tl.float32) * acc, mask=ok)


def latent_moe_decode(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scales: torch.Tensor, down_packed: torch.Tensor,
    down_scales: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, block_rows: int = 16,
    block_cols: int = 256, num_warps: int = 4,
) -> torch.Tensor:
    """u = sum_j p_j E_{id_j}(x) per token (eq.11's routed sum, in the latent width l).

    x [T, l]; expert_ids, expert_weights [T, k]; gate_up_* for W_gate;W_up stacked [E, 2F, l] and down_*
    for W_down [E, l, F], both MXFP4-packed. Returns u [T, l] in x's dtype.
    """
    T, L = x.shape
    E, two_f, half_l = gate_up_packed.shape
    F = two_f // 2
    K = expert_ids.shape[1]
    require(x.is_contiguous(), "x must be contiguous")
    require(half_l * 2 == L, f"gate_up_packed must be [E, 2F, {L // 2}], got {tuple(gate_up_packed.shape)}")
    require(gate_up_scales.shape == (E, two_f, L // 32), f"gate_up_scales must be [{E}, {two_f}, {L // 32}]")
    require(down_packed.shape == (E, L, F // 2), f"down_packed must be [{E}, {L}, {F // 2}], got "
            f"{tuple(down_packed.shape)}")
    require(down_scales.shape == (E, L, F // 32), f"down_scales must be [{E}, {L}, {F // 32}]")
    require(expert_weights.shape == (T, K), f"expert_weights must be [{T}, {K}] like expert_ids")
    require(gate_up_packed.dtype == torch.uint8 and down_packed.dtype == torch.uint8, "packed weights are uint8")
    bc = min(block_cols, L, F)
    require(bc >= 32 and bc == next_pow2(bc) and L % bc == 0 and F % bc == 0,
            f"l={L} and F={F} must be multiples of a power-of-two column block >= 32")
    ids = expert_ids.contiguous()
    h = torch.empty(T * K, F, dtype=torch.float32, device=x.device)
    _gate_up_situ_kernel[(T * K, triton.cdiv(F, block_rows))](
        x, ids, gate_up_packed, gate_up_scales, h, K, F, beta1, beta2, L=L, BR=block_rows, BC=bc,
        num_warps=num_warps,
    )
    # Down rows per (token, expert) pair as well, so that even one token keeps every SM streaming; the
    # k partial rows of a token are then summed (a [T, k, l] float32 reduction, tiny next to the weights).
    partial = torch.empty(T * K, L, dtype=torch.float32, device=x.device)
    _down_kernel[(T * K, triton.cdiv(L, block_rows))](
        h, ids, expert_weights.contiguous(), down_packed, down_scales, partial, K, F=F, L=L, BR=block_rows,
        BC=bc, num_warps=num_warps,
    )
    return partial.view(T, K, L).sum(1).to(x.dtype)
