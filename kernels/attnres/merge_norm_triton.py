"""Block AttnRes phase 2 fused with the RMSNorm that follows it (§5.4.2, K3 report eq.9-10).

Per token row: fold the intra-block partial sum into the site's inter-block online-softmax statistics
(max, denominator, accumulator from phase 1), emit h = acc / denom, and in the same pass the next
sub-layer's input RMSNorm(h) * w. One read of the statistics and the partial sum, two row writes: the
kernel is pure memory traffic, so the row is read once into registers and everything else is arithmetic.
The forwards only consume RMSNorm(h) (a sublayer's output goes into the block's partial sum, not into h), so
`store_h=False` skips h's write: a fifth of the bytes with a partial sum (prefill, an interim build: 1.13x).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _merge_norm_kernel(stat_max, stat_denom, stat_acc, query, key_norm_w, partial, out_norm_w, h_out,
                           normed_out, D, key_eps, out_eps, HAS_PARTIAL: tl.constexpr,
                           HAS_KEY_NORM_W: tl.constexpr, STORE_H: tl.constexpr, BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BD)
        ok = offs < D
        acc = tl.load(stat_acc + row * D + offs, mask=ok, other=0.0)
        denom = tl.load(stat_denom + row)
        if HAS_PARTIAL:
            mx = tl.load(stat_max + row)
            p = tl.load(partial + row * D + offs, mask=ok, other=0.0).to(tl.float32)
            q = tl.load(query + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_KEY_NORM_W:
                q = q * tl.load(key_norm_w + offs, mask=ok, other=0.0).to(tl.float32)
            logit = tl.sum(p * q, 0) * tl.rsqrt(tl.sum(p * p, 0) / D + key_eps)
            m_new = tl.maximum(mx, logit)
            old, new = tl.exp(mx - m_new), tl.exp(logit - m_new)
            acc = acc * old + new * p
            denom = denom * old + new
        h = (acc / denom).to(normed_out.dtype.element_ty)
        if STORE_H:
            tl.store(h_out + row * D + offs, h, mask=ok)
        hf = h.to(tl.float32)  # the norm reads h as stored, like the unfused pair of ops
        # The norm weight loaded last, not with the row: live from the start it took the D=7168 kernel from
        # 160 to 225 registers (3 -> 2 programs per SM) and 139.5 -> 164 us at prefill (session 8).
        w = tl.load(out_norm_w + offs, mask=ok, other=0.0).to(tl.float32)
        y = hf * tl.rsqrt(tl.sum(hf * hf, 0) / D + out_eps) * w
        tl.store(normed_out + row * D + offs, y.to(normed_out.dtype.element_ty), mask=ok)


def attnres_merge_norm(
    stat_max: torch.Tensor, stat_denom: torch.Tensor, stat_acc: torch.Tensor, query: torch.Tensor,
    partial: torch.Tensor | None, out_norm_weight: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
    key_eps: float = 1e-6, out_eps: float = 1e-6, out_dtype: torch.dtype | None = None,
    num_warps: int = 4, store_h: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """stat_* of one site ([M], [M], [M, D] float32, from k3core.ops.attnres.attnres_inter(...).row(i)),
    query [D], partial [M, D] or None (first site of a block) -> (h, RMSNorm(h) * out_norm_weight), both
    [M, D] in partial's dtype (out_dtype when partial is None).
    `store_h=False`: h is not written and None is returned in its place (the normed row is unchanged)."""
    M, D = stat_acc.shape
    require(stat_acc.dtype == torch.float32 and stat_acc.is_contiguous(), "stat_acc must be contiguous float32")
    require(stat_max.shape == (M,) and stat_denom.shape == (M,), f"stat_max and stat_denom must be [{M}]")
    require(query.shape == (D,) and out_norm_weight.shape == (D,), f"query and out_norm_weight must be [{D}]")
    if partial is not None:
        require(partial.shape == (M, D) and partial.is_contiguous(), f"partial must be contiguous [{M}, {D}]")
    dtype = partial.dtype if partial is not None else (out_dtype or stat_acc.dtype)
    normed = torch.empty(M, D, dtype=dtype, device=stat_acc.device)
    h = torch.empty_like(normed) if store_h else None
    _merge_norm_kernel[(M,)](
        stat_max.float().contiguous(), stat_denom.float().contiguous(), stat_acc, query,
        key_norm_weight if key_norm_weight is not None else query, partial if partial is not None else normed,
        out_norm_weight, h if store_h else normed, normed, D, key_eps, out_eps, HAS_PARTIAL=partial is not None,
        HAS_KEY_NORM_W=key_norm_weight is not None, STORE_H=store_h, BD=next_pow2(D), num_warps=num_warps,
    )
    return h, normed
