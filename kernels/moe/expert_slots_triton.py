"""Which (token, expert) pair serves an expert, and its tokens packed into slots (Triton jit helpers shared
by the latent-MoE decode kernels: the program of an expert's first pair serves every token routed to it)."""

from __future__ import annotations

from kernels._triton import tl, triton

if triton is not None:

    @triton.jit
    def expert_tokens(ids, pair, T, K, TP: tl.constexpr, BK: tl.constexpr):
        """For the expert of `pair`: whether `pair` is its first pair (the leader, which serves the expert),
        per token (TP >= T) the first of its pairs that names the expert (1 << 30 where none), the match
        mask of all its pairs and their flat indices."""
        e = tl.load(ids + pair)
        tok, slot = tl.arange(0, TP), tl.arange(0, BK)
        index = tok[:, None] * K + slot[None, :]
        match = tl.load(ids + index, mask=(tok[:, None] < T) & (slot[None, :] < K), other=-1) == e
        first = tl.min(tl.where(match, index, 1 << 30), 1)
        return e.to(tl.int64), tl.min(first, 0) == pair, first, match, index

    @triton.jit
    def slots(first, n0, BT: tl.constexpr):
        """Routed tokens packed into slots n0 .. n0 + BT: [BT, TP] one-hot map slot -> token (empty rows for
        unused slots), each slot's first pair (int64) and whether the slot holds a token."""
        routed = first < (1 << 30)
        rank = tl.cumsum(routed.to(tl.int32), 0) - 1
        hit = (rank[None, :] == (n0 + tl.arange(0, BT))[:, None]) & routed[None, :]
        return hit, tl.sum(tl.where(hit, first[None, :], 0), 1).to(tl.int64), tl.sum(hit.to(tl.int32), 1) > 0
