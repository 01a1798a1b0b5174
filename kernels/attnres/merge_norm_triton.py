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
from kernels.fused.rms_norm_rows_triton import rms_normalized

if triton is not None:

    @triton.jit
    def _logit(v, query, key_norm_w, offs, ok, D, key_eps, HAS_KEY_NORM_W: tl.constexpr):
        """q_eff . RMSNorm(v) of a source row v (float32 [BD]); the query is loaded here, so that it is live
        only while the logit is formed."""
        q = tl.load(query + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_KEY_NORM_W:
            q = q * tl.load(key_norm_w + offs, mask=ok, other=0.0).to(tl.float32)
        dot, square = tl.split(tl.sum(tl.join(v * q, v * v), 0))  # one reduction for both row sums
        return dot * tl.rsqrt(square / D + key_eps)

    @triton.jit
    def _fold(mx, denom, acc, v, logit):
        """The online-softmax statistics with one more source row v of the given logit folded in."""
        m_new = tl.maximum(mx, logit)
        old, new = tl.exp(mx - m_new), tl.exp(logit - m_new)
        return m_new, denom * old + new, acc * old + new * v

    @triton.jit
    def _fold_newest(stat_max, stat_denom, stat_acc, newest, query, key_norm_w, partial, row, offs, ok, D, key_eps,
                     HAS_STATS: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_KEY_NORM_W: tl.constexpr):
        """(acc, max, denominator) with the newest block (and the partial sum) folded in, in one round: every
        row is loaded first and the (up to) four row sums are one reduction, so a row waits for one
        load-reduce round instead of one per source (history 40: two rounds cost ~1 us more than a plain merge
        at decode)."""
        b = tl.load(newest + row * D + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_PARTIAL:
            p = tl.load(partial + row * D + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_STATS:
            acc = tl.load(stat_acc + row * D + offs, mask=ok, other=0.0)
            mx = tl.load(stat_max + row)
            denom = tl.load(stat_denom + row)
        q = tl.load(query + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_KEY_NORM_W:
            q = q * tl.load(key_norm_w + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_PARTIAL:  # [source (newest, partial), dot | square] in one reduction
            dots, squares = tl.split(tl.sum(tl.join(tl.join(b * q, p * q), tl.join(b * b, p * p)), 0))
            lb, lp = tl.split(dots * tl.rsqrt(squares / D + key_eps))
            top = tl.maximum(lb, lp)
        else:
            dot, square = tl.split(tl.sum(tl.join(b * q, b * b), 0))
            lb = dot * tl.rsqrt(square / D + key_eps)
            top = lb
        if HAS_STATS:
            top = tl.maximum(top, mx)
        wb = tl.exp(lb - top)
        total, weight = wb * b, wb
        if HAS_PARTIAL:
            wp = tl.exp(lp - top)
            total, weight = total + wp * p, weight + wp
        if HAS_STATS:
            old = tl.exp(mx - top)
            total, weight = acc * old + total, denom * old + weight
        return total, top, weight

    @triton.jit
    def _merge_norm_kernel(stat_max, stat_denom, stat_acc, newest, query, key_norm_w, partial, out_norm_w, h_out,
                           normed_out, D, key_eps, out_eps, HAS_STATS: tl.constexpr, HAS_NEWEST: tl.constexpr,
                           HAS_PARTIAL: tl.constexpr, HAS_KEY_NORM_W: tl.constexpr, STORE_H: tl.constexpr,
                           BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BD)
        ok = offs < D
        if HAS_NEWEST:
            acc, mx, denom = _fold_newest(stat_max, stat_denom, stat_acc, newest, query, key_norm_w, partial, row,
                                          offs, ok, D, key_eps, HAS_STATS, HAS_PARTIAL, HAS_KEY_NORM_W)
        else:
            acc = tl.load(stat_acc + row * D + offs, mask=ok, other=0.0)
            denom = tl.load(stat_denom + row)
            if HAS_PARTIAL:
                mx = tl.load(stat_max + row)
                p = tl.load(partial + row * D + offs, mask=ok, other=0.0).to(tl.float32)
                mx, denom, acc = _fold(mx, denom, acc, p, _logit(p, query, key_norm_w, offs, ok, D, key_eps,
                                                                 HAS_KEY_NORM_W))
        h = (acc / denom).to(normed_out.dtype.element_ty)
        if STORE_H:
            tl.store(h_out + row * D + offs, h, mask=ok)
        hf = h.to(tl.float32)  # the norm reads h as stored, like the unfused pair of ops
        # The norm weight loaded last, not with the row: live from the start it took the D=7168 kernel from
        # 160 to 225 registers (3 -> 2 programs per SM) and 139.5 -> 164 us at prefill (session 8).
        w = tl.load(out_norm_w + offs, mask=ok, other=0.0).to(tl.float32)
        y = rms_normalized(hf, D, out_eps) * w
        tl.store(normed_out + row * D + offs, y.to(normed_out.dtype.element_ty), mask=ok)


def attnres_merge_norm(
    stat_max: torch.Tensor | None, stat_denom: torch.Tensor | None, stat_acc: torch.Tensor | None,
    query: torch.Tensor, partial: torch.Tensor | None, out_norm_weight: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None, key_eps: float = 1e-6, out_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None, num_warps: int | None = None, store_h: bool = True,
    newest: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """stat_* of one site ([M], [M], [M, D] float32, from k3core.ops.attnres.attnres_inter(...).row(i)),
    query [D], partial [M, D] or None (first site of a block) -> (h, RMSNorm(h) * out_norm_weight), both
    [M, D] in partial's dtype (out_dtype, else stat_acc's or newest's, when partial is None).
    `store_h=False`: h is not written and None is returned in its place (the normed row is unchanged).
    `newest` [M, D]: one more completed block, folded in after the statistics and before the partial sum
    (its logit formed here), so that the statistics need not cover it: the decode path's phase 1 of a block
    then reads only blocks completed a block earlier and runs off the critical path. The statistics may
    then be None (no older block: all three None).
    `num_warps` None: 4, or 8 when a newest block is folded in at D > 4096 (three float32 rows live)."""
    ref = stat_acc if stat_acc is not None else newest
    require(ref is not None, "stat_acc or newest must be given")
    M, D = ref.shape
    has_stats = stat_acc is not None
    require(has_stats or (stat_max is None and stat_denom is None), "stat_max, stat_denom, stat_acc: all or none")
    if has_stats:
        require(stat_acc.dtype == torch.float32 and stat_acc.is_contiguous(), "stat_acc must be contiguous float32")
        require(stat_max.shape == (M,) and stat_denom.shape == (M,), f"stat_max and stat_denom must be [{M}]")
    require(query.shape == (D,) and out_norm_weight.shape == (D,), f"query and out_norm_weight must be [{D}]")
    for name, src in (("partial", partial), ("newest", newest)):
        if src is not None:
            require(src.shape == (M, D) and src.is_contiguous(), f"{name} must be contiguous [{M}, {D}]")
    dtype = partial.dtype if partial is not None else (out_dtype or ref.dtype)
    normed = torch.empty(M, D, dtype=dtype, device=ref.device)
    h = torch.empty_like(normed) if store_h else None
    BD = next_pow2(D)
    if num_warps is None:
        num_warps = 8 if newest is not None and BD > 4096 else 4
    _merge_norm_kernel[(M,)](
        stat_max.float().contiguous() if has_stats else normed, stat_denom.float().contiguous() if has_stats else normed,
        stat_acc if has_stats else normed, newest if newest is not None else normed, query,
        key_norm_weight if key_norm_weight is not None else query, partial if partial is not None else normed,
        out_norm_weight, h if store_h else normed, normed, D, key_eps, out_eps, HAS_STATS=has_stats,
        HAS_NEWEST=newest is not None, HAS_PARTIAL=partial is not None,
        HAS_KEY_NORM_W=key_norm_weight is not None, STORE_H=store_h, BD=BD, num_warps=num_warps,
    )
    return h, normed
