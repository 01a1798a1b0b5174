"""Decode (one new token per sequence) of the two attention kinds through `kernels.dispatch`, on the pool.

KDA: the fused decode step updates the state and conv window in place in the request's KDA state page, one
launch per layer over all heads on the layer's strided `[pages, H, D, D]` view (see `pool_views`), its
inputs read straight from the projection GEMM's output (row-strided slices, no re-layout). MLA: the query's
q_a slice is normalised where the fused input GEMM wrote it (`dispatch.rms_norm_rows`), the new latent row
normalised and written straight into its page slot (`dispatch.mla_latent_write`), then the
weight-absorbed query attends over the pool's latent pages through the page table (split-KV kernel), and
the output gate reads the head-major values in place (`dispatch.gated_heads`). Every output projection
adds into the residual in its GEMM's epilogue (`linear_add`).
No host sync and no per-sequence Python: every shape depends on the batch size only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from k3core.cache.pool_views import PoolViews
from k3core.config import K3Config
from k3core.layers.kda import KimiDeltaAttention
from k3core.layers.mla import GatedMLA
from k3core.ops.mla import split_kv_b
from kernels import dispatch
from services.engine.derived_weights import DerivedWeights

L2_EPS = 1e-6  # k3core.ops.kda.l2norm's default, what the reference layer uses
MLA_SPLITS_ENV = "K3_MLA_SPLITS"  # a fixed split count for the MLA decode kernel (bench.serve --variant); unset:
# the launcher's rule (kernels/mla/decode_triton.default_splits)


def mla_tuning(q: torch.Tensor) -> dict[str, int]:
    """The MLA decode launcher's tuning from the environment, read when a forward is traced or captured (only
    on the Triton path: the reference takes none)."""
    splits = os.environ.get(MLA_SPLITS_ENV)
    return {"num_splits": int(splits)} if splits and dispatch.use_triton(q) else {}


# "0": the absorbed query's rope copy on the main chain, not on the latent write's branch (H200, mini, B=64:
# 2.3 us a layer off the chain, docs/serving.md item 23)
MLA_ROPE_BRANCH_ENV = "K3_MLA_ROPE_BRANCH"
BRANCHES_ENV = "K3_DECODE_BRANCHES"  # "0": every kernel of a captured layer in one chain (no side branch)
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def fork(x: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream] | None = None) -> torch.cuda.Stream | None:
    """While a CUDA graph is captured: a second stream of x's device that has waited for everything queued so far
    on the current one, for work of a layer that only the layer's end needs (in the graph a parallel branch, so
    a latency-bound kernel runs beside the main chain's GEMMs instead of between them: 3-6 us a MoE layer at
    batch 64 on the H200, docs/serving.md item 11). None otherwise (eager forwards are host-bound: two more
    CUDA calls a fork would cost more than they hide) and with K3_DECODE_BRANCHES=0.
    Pair with `join` before the first reader of the branch's outputs. What the branch allocates is freed only
    on its own stream's pool, whose next user waits at the next fork: no `record_stream` needed.
    `streams`: where the branch's stream is kept, per device (default: the layers' shared one); a branch that
    spans other branches needs its own (on the shared stream the first of them would join it)."""
    if not x.is_cuda or os.environ.get(BRANCHES_ENV, "1") == "0" or not torch.cuda.is_current_stream_capturing():
        return None
    streams = _SIDE_STREAMS if streams is None else streams
    side = streams.get(x.device)
    if side is None:
        side = streams[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    return side


def on(side: torch.cuda.Stream | None) -> AbstractContextManager:
    """The branch's stream as the current one (nothing to switch without a branch)."""
    return nullcontext() if side is None else torch.cuda.stream(side)


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for the branch's work."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's output in one fused op (k3core.ops.norm.rms_norm computes the same in float32)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T, or `residual` += x @ weight.T in the GEMM's epilogue, in place (one launch; the
    out-of-place addmm copies the residual first). `residual` must be the forward's own running sum.
    cuBLAS, or the skinny Triton GEMM for the shapes it measured faster at (`dispatch.skinny_linear`)."""
    return dispatch.skinny_linear(x, weight, residual)


class Projection(NamedTuple):
    """One GEMM a decode step routes through `linear_add` (so `dispatch.skinny_linear`): x [rows, k] @
    W [n, k]^T, added into a residual in its epilogue when `residual`. What each form's `projections` lists,
    on an unsharded rank; the fast path's other GEMMs (F.linear, bmm) are not in it."""

    name: str
    n: int
    k: int
    residual: bool


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor:
    """One weight for several projections of the same input (one GEMM instead of several). The modules'
    weights become views of it, so nothing is duplicated and the reference path sees the same numbers."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


class KdaDecode:
    def __init__(self, attn: KimiDeltaAttention, views: PoolViews, derived: DerivedWeights) -> None:
        self.attn = attn
        gate = [attn.g_proj] if attn.full_rank_gate else [attn.g_a_proj]
        inputs = [attn.q_proj, attn.k_proj, attn.v_proj, *gate, attn.f_a_proj, attn.b_proj]
        self.weight = fuse_linears(inputs)
        self.splits = [lin.weight.shape[0] for lin in inputs]
        self.conv_w = derived.derive(attn.stacked_conv_weight)  # [3, H*D, W]
        self.a_log = derived.derive(lambda: attn.A_log.reshape(attn.heads).contiguous())
        self.dt_bias = derived.derive(lambda: attn.dt_bias.reshape(-1).contiguous())
        self.state = views.kda_state(attn.kda_index)
        self.conv = views.kda_conv(attn.kda_index)
        # The step kernel; None: `dispatch.kda_decode_step`, looked up per call. A verify forward sets its
        # window form here for the duration of the forward (services/engine/fast_verify.py).
        self.step: Callable[..., torch.Tensor] | None = None

    @staticmethod
    def projections(c: K3Config, residual: bool) -> list[Projection]:
        """`__call__`'s `linear_add` GEMMs in call order (`residual`: whether the call is given one); the
        low-rank gate's g_b_proj runs as its module."""
        proj, dim, hidden = c.kda_projection_size, c.kda_head_dim, c.hidden_size
        gate = proj if c.use_full_rank_gate else dim
        return [Projection("kda in (q|k|v|g|f_a|b)", 3 * proj + gate + dim + c.kda_num_heads, hidden, False),
                Projection("kda f_b", proj, dim, False), Projection("kda out", hidden, proj, residual)]

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, hidden] (normed) -> [B, hidden] (+ residual); slots [B]: each sequence's KDA state page of
        this group."""
        attn, batch = self.attn, x.shape[0]
        heads, dim = attn.heads, attn.head_dim
        q, k, v, g, f_a, beta = linear_add(x, self.weight, None).split(self.splits, dim=-1)
        z = linear_add(f_a, attn.f_b_proj.weight, None)
        if not attn.full_rank_gate:
            g = attn.g_b_proj(g)
        q, k, v, z, g = (t.view(batch, heads, dim) for t in (q, k, v, z, g))  # row-strided views, no copy
        step = dispatch.kda_decode_step if self.step is None else self.step
        y = step(q, k, v, z, beta, g, self.conv_w, self.a_log, self.dt_bias,
                                     attn.o_norm.weight, self.state, self.conv, slots,
                                     lower_bound=attn.lower_bound, scale=attn.scale, l2_eps=L2_EPS,
                                     norm_eps=attn.eps)  # [B, H, D]
        return linear_add(y.reshape(batch, heads * dim), attn.o_proj.weight, residual)


class MlaDecode:
    def __init__(self, attn: GatedMLA, views: PoolViews, derived: DerivedWeights) -> None:
        self.attn = attn
        inputs = [attn.q_a_proj if attn.q_lora else attn.q_proj, attn.kv_a_proj_with_mqa]
        inputs += [attn.g_proj] if attn.output_gate else []
        self.weight = fuse_linears(inputs)
        self.splits = [lin.weight.shape[0] for lin in inputs]
        def kv_b() -> tuple[torch.Tensor, torch.Tensor]:
            return split_kv_b(attn.kv_b_proj.weight, attn.heads, attn.v_dim)

        self.w_uk = derived.derive(lambda: kv_b()[0].contiguous())  # [H, Dn, R]
        self.w_uv_t = derived.derive(lambda: kv_b()[1].transpose(1, 2).contiguous())  # [H, R, Dv]
        self.cache = views.mla_cache(attn.mla_index)
        self.rows = views.mla_rows()
        self.slot = views.layout.mla_slot(attn.mla_index)[1]  # added to the group's row base by the write

    @staticmethod
    def projections(c: K3Config, residual: bool) -> list[Projection]:
        """`__call__`'s `linear_add` GEMMs: the output projection only (the fused input GEMM and q_b run as
        F.linear, the absorbed products as bmm)."""
        return [Projection("mla out", c.hidden_size, c.num_attention_heads * c.v_head_dim, residual)]

    def __call__(self, x: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                 row_base: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, hidden] (normed) -> [B, hidden] (+ residual); page_table [B, max_pages]; lengths [B] (tokens
        incl. the new one); row_base [B]: the row of the layer group's slot 0 in `views.mla_rows()` for each new
        latent (the write adds this layer's slot in its kernel: no add launch per layer)."""
        attn, batch = self.attn, x.shape[0]
        parts = F.linear(x, self.weight).split(self.splits, dim=-1)
        if attn.q_lora:  # the strided q_a slice read in place, one launch (torch's rms_norm copies it first)
            norm_q = attn.q_a_layernorm
            q = attn.q_b_proj(dispatch.rms_norm_rows(parts[0], norm_q.weight, norm_q.eps))
        else:
            q = parts[0]
        q = q.reshape(batch, attn.heads, attn.nope + attn.rope)
        norm = attn.kv_a_layernorm
        # [q_nope W_uk | q_pe] per head: the batched GEMM writes its [H, B, R] product straight into the latent
        # columns of the absorbed query (a strided output cuBLAS takes as is), only the rope part is copied
        # (a concat cost a 4.6 us launch a layer at batch 64 on the H200). Allocated before the fork: the branch
        # writes it.
        absorbed = q.new_empty(batch, attn.heads, attn.rank + attn.rope)
        rope_beside = os.environ.get(MLA_ROPE_BRANCH_ENV, "1") != "0"
        side = fork(x)  # the latent row's write (and the rope copy) beside the product; read after the join
        with on(side):
            dispatch.mla_latent_write(parts[1], norm.weight, norm.eps, self.rows, row_base, self.slot)
            if rope_beside:  # disjoint columns from the product's
                absorbed[..., attn.rank :] = q[..., attn.nope :]
        torch.bmm(q[..., : attn.nope].transpose(0, 1), self.w_uk.to(q.dtype),
                  out=absorbed.transpose(0, 1)[..., : attn.rank])
        if not rope_beside:
            absorbed[..., attn.rank :] = q[..., attn.nope :]
        join(side)
        absorbed = absorbed.to(self.cache.dtype)
        o_latent = dispatch.mla_decode_paged(absorbed, self.cache, page_table, lengths, attn.scale,
                                             latent_dim=attn.rank, **mla_tuning(absorbed))
        o = torch.bmm(o_latent.transpose(0, 1).to(x.dtype), self.w_uv_t.to(x.dtype))  # [H, B, Dv]
        o = dispatch.gated_heads(o, parts[2]) if attn.output_gate else o.transpose(0, 1).reshape(batch, -1)
        return linear_add(o, attn.o_proj.weight, residual)
