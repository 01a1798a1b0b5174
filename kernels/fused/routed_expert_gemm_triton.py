"""The routed experts' GEMMs of one decode step, each expert multiplied only with the tokens routed to it (the
routed MoE form; the dense form in expert_gemm_triton.py multiplies every expert with every token and
`moe_combine` throws 1 - k/E of it away: 7/8 at mini's top-4 of 32).

Rows are the (token, expert) pairs sorted by expert, ties by pair id: `moe_align`'s layout, which `moe_combine`
reads for the grouped form. Each program finds its expert's rows from the router's indices [T, k] itself (its
first row: the pairs of lower experts; its tokens: those that picked it, in order; a few hundred ids from L2),
so no alignment launch stands between the router and the GEMMs; the gate|up's first column tile writes each
pair's row (moe_align's `position`) for the combine. gate|up: act[r] = GLU(w13[e] @ z[token of r]) -> act
[R, F]; down: out[r] = w2[e] @ act[r] -> [R, l]. Swap A/B: the weight block is the MMA's M side (BLOCK_N rows), the expert's rows the
N side (BLOCK_T, 16 or 32): a decode expert sees ~T*k/E tokens (8 at 64 tokens), so its tensor work and its
output stores shrink with the routing while the weight stream (what a decode GEMM is bound by) stays one
read per weight block. Program = (BLOCK_N weight rows, one expert); it walks its expert's rows BLOCK_T at a
time (a second pass re-reads the weight block, then from L2), and an expert no token picked reads nothing.
Weights through TMA descriptors of the stacked 2-D views (rows past a block's expert belong to the next
expert: the store is masked), or pointer tiles (`tma=False`); the activations rows by pointers (gathered).
`padding` (marker [T], value): the tokens whose marker is the value (a CUDA-graph bucket's padding rows, alike,
so all on the same top-k experts) are routed to no expert: no rows, passes or expert reads of theirs; their
pairs' position is row R, which the down projection adds as zeros for moe_combine. Only the row scan changes
(sm_90a, Triton 3.6: without `padding` the k-loops' SASS is unchanged, differences before the first branch).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.expert_gemm_triton import ACTIVATIONS, _tma_ready
from kernels.fused.naive import Padding, require_activation

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.moe.situ_glu_triton import glu_values

    @triton.jit
    def _weight_block(w, w_desc, row, cols_ok, k0, stride_wn, ks, K, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """[BLOCK_N, BLOCK_K] weight rows row.. at depth k0 (TMA: out-of-range zeros; pointers: masked)."""
        if TMA:
            return w_desc.load([row, k0])
        ok = cols_ok[:, None]
        if not EVEN_K:
            ok = ok & (k0 + ks < K)[None, :]
        rows = row + tl.arange(0, BLOCK_N)
        return tl.load(w + rows.to(tl.int64)[:, None] * stride_wn + (k0 + ks)[None, :], mask=ok, other=0.0)

    @triton.jit
    def _live_tokens(marker, skip, T, PADDING: tl.constexpr, BLOCK_P: tl.constexpr):
        """[BLOCK_P] whether each token is routed: in range and, with PADDING, its marker not `skip`."""
        tokens = tl.arange(0, BLOCK_P)
        live = tokens < T
        if PADDING:
            live = live & (tl.load(marker + tokens, mask=live, other=skip) != skip)
        return live

    @triton.jit
    def _expert_rows(indices, marker, skip, expert, T, PADDING: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK_P: tl.constexpr, TOP_K_P2: tl.constexpr):
        """The expert's place in the expert-sorted rows, from the routing [T, TOP_K] alone: (its first row, its row
        count, per token whether it picked the expert, its rank among those tokens, the [BLOCK_P, TOP_K_P2] mask
        of the picking pairs). An expert appears once per token at most, so its pairs in pair order are its
        tokens in order (moe_align's ties by pair id). Padding tokens (`_live_tokens`) pick nothing."""
        slots = tl.arange(0, TOP_K_P2)
        ok = _live_tokens(marker, skip, T, PADDING, BLOCK_P)[:, None] & (slots < TOP_K)[None, :]
        ids = tl.load(indices + tl.arange(0, BLOCK_P)[:, None] * TOP_K + slots[None, :], mask=ok, other=-1)
        picks = ids == expert
        first = tl.sum(tl.sum(((ids < expert) & ok).to(tl.int32), axis=1), axis=0)
        has = tl.max(picks.to(tl.int32), axis=1)
        return first, tl.sum(has, axis=0), has, tl.cumsum(has, axis=0) - 1, picks

    @triton.jit
    def _routed_gemm_kernel(x, indices, position, marker, skip, w, w_desc, out, T, N, K, stride_x, stride_wn,
                            stride_o, w_rows_per_expert, beta1, beta2, ACT: tl.constexpr, GATHER: tl.constexpr,
                            PADDING: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, TOP_K: tl.constexpr,
                            TOP_K_P2: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows of expert e: the routing's pairs that picked it, sorted by expert (`_expert_rows`). GATHER
        (gate|up): row r reads x[its token] and the column tile 0's programs write each pair's row into
        position [T, TOP_K]; else (down) row r reads x[r]. w [E*w_rows_per_expert, K]; with a GLU (ACT > 0) the
        up rows sit N rows after the gate rows. out [R, N]. PADDING: tokens whose marker is `skip` are routed
        to no expert; expert 0's programs point their pairs' positions at row R = T*TOP_K (gate|up) and write
        that row of out as zeros (down: out [R + 1, N])."""
        n0 = tl.program_id(0) * BLOCK_N
        expert = tl.program_id(1)
        first, count, has, rank, picks = _expert_rows(indices, marker, skip, expert, T, PADDING, TOP_K, BLOCK_P,
                                                      TOP_K_P2)
        token_ids = tl.arange(0, BLOCK_P)
        if GATHER:
            if tl.program_id(0) == 0:
                slots = tl.arange(0, TOP_K_P2)
                row = (first + rank)[:, None] + tl.zeros([BLOCK_P, TOP_K_P2], dtype=tl.int32)
                if PADDING:  # padding pairs: row R, the zero row the down projection adds
                    if expert == 0:
                        pad = ~_live_tokens(marker, skip, T, PADDING, BLOCK_P) & (token_ids < T)
                        picks = picks | (pad[:, None] & (slots < TOP_K)[None, :])
                        row = tl.where(pad[:, None], T * TOP_K, row)
                tl.store(position + token_ids[:, None] * TOP_K + slots[None, :], row.to(tl.int64), mask=picks)
        cols = n0 + tl.arange(0, BLOCK_N)
        cols_ok = cols < N
        if PADDING:
            if not GATHER:
                if expert == 0:
                    zeros = tl.zeros([BLOCK_N], dtype=out.dtype.element_ty)
                    row_r = tl.zeros([BLOCK_N], dtype=tl.int64) + T * TOP_K
                    tl.store(out + row_r * stride_o + cols, zeros, mask=cols_ok)
        ks = tl.arange(0, BLOCK_K)
        w_row = expert * w_rows_per_expert + n0
        for t0 in range(0, count, BLOCK_T):
            here = t0 + tl.arange(0, BLOCK_T)
            rows_ok = here < count
            rows = first + here
            src = rows
            if GATHER:  # the token of the expert's here-th pair
                match = (rank[None, :] == here[:, None]) & (has[None, :] > 0)
                src = tl.sum(tl.where(match, token_ids[None, :], 0), axis=1)
            x_at = x + src.to(tl.int64)[:, None] * stride_x + ks[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x_ok = rows_ok[:, None]
                if not EVEN_K:
                    x_ok = x_ok & (k0 + ks < K)[None, :]
                xt = tl.trans(tl.load(x_at + k0, mask=x_ok, other=0.0))  # [BLOCK_K, BLOCK_T]
                gate = _weight_block(w, w_desc, w_row, cols_ok, k0, stride_wn, ks, K, TMA, EVEN_K, BLOCK_N)
                acc = tl.dot(gate, xt, acc, input_precision="ieee")
                if ACT != 0:
                    up_w = _weight_block(w, w_desc, w_row + N, cols_ok, k0, stride_wn, ks, K, TMA, EVEN_K, BLOCK_N)
                    up = tl.dot(up_w, xt, up, input_precision="ieee")
            if ACT != 0:
                acc = glu_values(acc, up, beta1, beta2, ACT == 1)
            target = out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
            tl.store(target, tl.trans(acc).to(out.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


def _launch(x: torch.Tensor, indices: torch.Tensor, position: torch.Tensor | None, w: torch.Tensor,
            out: torch.Tensor, act: int, width: int, beta1: float, beta2: float, block_n: int, block_t: int | None,
            block_k: int, num_warps: int, num_stages: int, tma: bool, padding: Padding | None) -> torch.Tensor:
    """x rows [*, K], routing indices [T, k], w [E, rows, K] -> out [R = T*k (+ 1 with `padding` in the down
    projection), width]. block_t None: 16 rows up to 8 rows an expert on average, else 32 (one pass for most
    experts)."""
    experts, depth = w.shape[0], x.shape[1]
    rows = out.shape[0] - (padding is not None and position is None)  # less the down projection's zero row
    require(indices.dim() == 2 and indices.shape[0] * indices.shape[1] == rows and indices.is_contiguous(),
            f"indices must be the contiguous routing [T, k] of the {rows} rows, got {tuple(indices.shape)}")
    if padding is not None:
        require(padding[0].shape == (indices.shape[0],) and padding[0].stride(0) == 1,
                f"the padding marker must be one value per token [{indices.shape[0]}], got {tuple(padding[0].shape)}")
    if rows == 0:
        return out
    block_k = min(block_k, max(16, next_pow2(depth)))
    block_t = block_t or (16 if rows <= 8 * experts else 32)
    w2d = w.view(experts * w.shape[1], depth) if w.is_contiguous() else None
    if tma:
        require(w2d is not None and _tma_ready(w2d), "tma=True needs contiguous, 16-byte aligned weight rows")
        w_desc = TensorDescriptor.from_tensor(w2d, [block_n, block_k])
    else:
        require(w.stride(0) == w.shape[1] * w.stride(1), "the pointer form needs the experts' rows evenly strided")
        w_desc = None
    tokens, top_k = indices.shape
    marker, skip = (indices, 0) if padding is None else padding
    _routed_gemm_kernel[(triton.cdiv(width, block_n), experts)](
        x, indices, position, marker, skip, w, w_desc, out, tokens, width, depth, x.stride(0), w.stride(1),
        out.stride(0), w.shape[1], float(beta1), float(beta2), ACT=act, GATHER=position is not None,
        PADDING=padding is not None, TMA=tma,
        EVEN_K=depth % block_k == 0, TOP_K=top_k, TOP_K_P2=next_pow2(top_k), BLOCK_P=max(16, next_pow2(tokens)),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def routed_expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, indices: torch.Tensor, activation: str = "situ",
                              beta1: float = 4.0, beta2: float = 25.0, block_n: int = 64,
                              block_t: int | None = None, block_k: int = 64, num_warps: int = 4, num_stages: int = 4,
                              tma: bool = True, padding: Padding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.fused.naive.routed_expert_gate_up_glu: z [T, l] (row-strided allowed), w13
    [E, 2F, l], the routing indices [T, k] -> (act [R = T*k, F] in z's dtype, rows sorted by expert; the row
    of each pair [T, k] int64, moe_align's position); `padding` (marker [T], value) as there."""
    require_activation(activation)
    require(z.dim() == 2 and w13.dim() == 3 and w13.shape[2] == z.shape[1] and w13.shape[1] % 2 == 0,
            f"z must be [T, l] and w13 [E, 2F, l], got {tuple(z.shape)} and {tuple(w13.shape)}")
    require(z.dtype == w13.dtype, f"z and w13 must share a dtype, got {z.dtype} and {w13.dtype}")
    require(z.stride(1) == 1 and w13.stride(2) == 1, "z and w13 need a unit stride along l")
    require(indices.dim() == 2 and indices.shape[0] == z.shape[0],
            f"indices must be [T={z.shape[0]}, k], got {tuple(indices.shape)}")
    width = w13.shape[1] // 2
    out = torch.empty(indices.numel(), width, dtype=z.dtype, device=z.device)
    position = torch.empty(indices.shape, dtype=torch.int64, device=z.device)
    _launch(z, indices, position, w13, out, ACTIVATIONS[activation], width, beta1, beta2, block_n, block_t, block_k,
            num_warps, num_stages, tma, padding)
    return out, position


def routed_expert_down(act: torch.Tensor, w2: torch.Tensor, indices: torch.Tensor, block_n: int = 64,
                       block_t: int | None = None, block_k: int = 64, num_warps: int = 4, num_stages: int = 4,
                       tma: bool = True, padding: Padding | None = None) -> torch.Tensor:
    """Same contract as kernels.fused.naive.routed_expert_down: act [R = T*k, F] (rows sorted by expert, as
    routed_expert_gate_up_glu gives them), w2 [E, l, F], the routing indices [T, k] -> [R, l] in act's dtype
    (float32 accumulators); with `padding` [R + 1, l], row R zeros."""
    require(act.dim() == 2 and w2.dim() == 3 and act.shape[1] == w2.shape[2],
            f"act must be [R, F] and w2 [E, l, F], got {tuple(act.shape)} and {tuple(w2.shape)}")
    require(act.dtype == w2.dtype, f"act and w2 must share a dtype, got {act.dtype} and {w2.dtype}")
    require(act.stride(1) == 1 and w2.stride(2) == 1, "act and w2 need a unit stride along F")
    out = torch.empty(act.shape[0] + (padding is not None), w2.shape[1], dtype=act.dtype, device=act.device)
    return _launch(act, indices, None, w2, out, ACTIVATIONS["none"], w2.shape[1], 1.0, 1.0, block_n, block_t,
                   block_k, num_warps, num_stages, tma, padding)
