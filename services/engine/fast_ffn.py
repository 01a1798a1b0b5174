"""Feed-forward of the decode fast path: gated MLPs with one gate|up GEMM, and the latent MoE in a handful of
launches (no per-expert loop, no host sync).

Latent MoE at one step (`MoeDecode`): the router in one kernel (`dispatch.moe_route`: logits accumulated in
float32, sigmoid, bias, top-k, renormalise, scale); one GEMM for everything that reads x (the routed down
projection and the shared experts' gate|up); the routed experts (below); one kernel for the tail
(`dispatch.moe_combine`: the picked expert rows weighted and summed, the latent RMSNorm, the shared experts'
activation beside it); one GEMM of that against [W_up | W_shared_down] (a derived, refreshable copy), with
the residual added in the GEMM's epilogue.
Routed experts: the weights are stacked once into [E, 2F, l] and [E, l, F] (the modules' weights become
views of them). Few tokens (few experts read) or many: pairs sorted by expert and `torch._grouped_mm` over
each expert's run of rows. Mid-size batches where every expert is read anyway: one kernel for every
expert's gate|up GEMM with the activation in its epilogue (`dispatch.expert_gate_up_glu`), one batched
GEMM for the down projections; the combine then reads only the picked (expert, token) rows. Or, in the same
range with `K3_DENSE_EXPERTS=routed` (the default), each expert only with its routed tokens (`dispatch.routed_expert_*`:
the grouped form's rows, found by the kernels from the routing, the weights streamed once by one Triton launch
each); the router's branch then joins before the expert GEMMs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from k3core.config import K3Config
from k3core.layers.mlp import GatedMLP
from k3core.layers.moe import SparseMoE
from k3core.ops.moe import swiglu
from kernels import dispatch
from kernels.fused.naive import Padding
from services.engine.derived_weights import DerivedWeights
from services.engine.fast_attention import Projection, fork, fuse_linears, join, linear_add, on, rms

ExpertRows = tuple[torch.Tensor, torch.Tensor, int, int]  # rows, index, index_stride, token_stride (moe_combine)
RoutedSum = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (z, weights, indices) -> [T, l]
# The dense experts' kernels on the device (`K3_DENSE_EXPERTS`, read when a forward is traced or captured):
# name -> (gate|up + GLU launcher tuning, down projection's tuning; None: cuBLAS's batched GEMM). bench.serve
# compares them in one process with `--variant`; bench.serve_glue times each kernel alone.
DENSE_FORMS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "pointer": ({}, None),
    "tma": ({"tma": True}, None),
    "tma-down": ({"tma": True}, {"tma": True}),
}
# The most rows a grouped model runs the dense range's forms at (`MoeDecode.dense`), and the routed form at.
DENSE_MAX_TOKENS = 128
# Not a dense form: in the dense range (up to DENSE_MAX_TOKENS), each expert's GEMMs over its routed tokens
# only (a tensor-parallel rank, whose sentinel expert takes the other ranks' pairs, keeps the dense form, as
# "tma-down"). The default: one MoE layer at 16 / 64 / 128 tokens 63.5 / 65.5 / 75.5 us against tma-down's
# 65.9 / 67.3 / 84.9 (H200, bench.serve_glue, session 9, docs/serving.md item 19).
ROUTED_FORM = "routed"
DENSE_FORM_ENV, DEFAULT_DENSE_FORM = "K3_DENSE_EXPERTS", ROUTED_FORM
# Above this many rows every form runs as "pointer": there the Triton down projection lost to cuBLAS (H200,
# bench.serve_glue, session 7: 14.8 / 16.3 vs 15.1 / 17.1 us at 16 / 64 tokens, 20.7 vs 18.3 at 96, 21.8 vs
# 19.8 at 128) and the TMA gate|up did not win (40.6 vs 38.6 us at 96, 37.9 vs 39.3 at 128).
FORM_MAX_TOKENS = 64


def expert_form_name() -> str:
    """`K3_DENSE_EXPERTS`: a name of DENSE_FORMS or ROUTED_FORM."""
    name = os.environ.get(DENSE_FORM_ENV, DEFAULT_DENSE_FORM)
    if name not in DENSE_FORMS and name != ROUTED_FORM:
        raise ValueError(f"{DENSE_FORM_ENV}={name!r}: expected one of {sorted([*DENSE_FORMS, ROUTED_FORM])}")
    return name


def dense_form(tokens: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    name = expert_form_name()
    if tokens > FORM_MAX_TOKENS:
        name = "pointer"
    elif name == ROUTED_FORM:  # where a routed setting meets the dense form (a tensor-parallel rank)
        name = "tma-down"
    return DENSE_FORMS[name]


def glu_activation(config: K3Config, gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2F] (gate | up) -> [..., F] with the model's activation (SiTU-GLU fused kernel, or SwiGLU)."""
    if config.hidden_act == "situ":
        return dispatch.situ_glu_fused(gate_up, config.situ_beta, config.situ_linear_beta)
    width = gate_up.shape[-1] // 2
    return swiglu(gate_up[..., :width], gate_up[..., width:])


class MlpDecode:
    def __init__(self, mlp: GatedMLP, config: K3Config) -> None:
        self.mlp, self.config = mlp, config
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])

    @staticmethod
    def projections(c: K3Config, residual: bool) -> list[Projection]:
        """`__call__`'s `linear_add` GEMMs: the down projection (the gate|up GEMM runs as F.linear)."""
        return [Projection("mlp down", c.hidden_size, c.intermediate_size, residual)]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        act = glu_activation(self.config, F.linear(x, self.gate_up))
        return linear_add(act, self.mlp.down_proj.weight, residual)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here (CUDA: Hopper+ in recent torch, bf16; CPU: a reference fallback).
    On CUDA only bf16 has the grouped kernel: other dtypes run a fallback that copies to the host, which a
    CUDA-graph capture refuses (found on the H200 with fp32 nano in the decode graphs)."""
    if not hasattr(torch, "_grouped_mm") or (device.type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        a = torch.zeros(2, 16, dtype=dtype, device=device)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


@contextmanager
def padding_rows(ffn: list, marker: torch.Tensor, value: int) -> Iterator[None]:
    """Within the block, the MoE layers of `ffn` (a decoder's feed-forward ops) know the rows whose `marker` [B]
    is `value` as padding (`MoeDecode.padding`); a forward captured in a CUDA graph reads the marker at replay."""
    layers = [op for op in ffn if isinstance(op, MoeDecode)]
    for op in layers:
        op.padding = (marker, value)
    try:
        yield
    finally:
        for op in layers:
            op.padding = None


class MoeDecode:
    def __init__(self, moe: SparseMoE, config: K3Config, grouped: bool, derived: DerivedWeights | None = None) -> None:
        self.moe, self.config, self.grouped = moe, config, grouped
        self.derived = DerivedWeights() if derived is None else derived
        experts = list(moe.experts)
        ffn = experts[0].w1.weight.shape[0]
        self.w13 = torch.stack([torch.cat([e.w1.weight.detach(), e.w3.weight.detach()]) for e in experts])
        self.w2 = torch.stack([e.w2.weight.detach() for e in experts])  # [E, l, F]
        for i, e in enumerate(experts):  # the modules now view the stacked weights: no second copy
            e.w1.weight.data, e.w3.weight.data = self.w13[i, :ffn], self.w13[i, ffn:]
            e.w2.weight.data = self.w2[i]
        shared = moe.shared_experts
        self.shared_down = shared.down_proj.weight if shared is not None else None
        readers = ([moe.routed_expert_down_proj] if moe.latent else []) + \
            ([shared.gate_proj, shared.up_proj] if shared is not None else [])
        self.in_weight = fuse_linears(readers) if readers else None  # one GEMM for every reader of x
        self.width = moe.routed_expert_down_proj.weight.shape[0] if moe.latent else config.hidden_size
        self.out_weight = None
        if moe.latent:  # [normed routed | shared activation] @ [W_up | W_shared_down]^T: one GEMM, no add
            up = moe.routed_expert_up_proj.weight
            self.out_weight = up if shared is None else \
                self.derived.derive(lambda: torch.cat([up, shared.down_proj.weight], dim=1))
        # The router kernel accumulates in float32 (MoEGate's float32 logits) from the weight as stored.
        self.router = moe.gate.weight.detach()
        self.activation = "situ" if config.hidden_act == "situ" else "swiglu"
        # Set by a tensor-parallel rank (fast_tensor_parallel.ShardedMoe): the routed sum goes through it (this
        # rank's experts' share, all-reduced between the sum and the latent norm), so the tail runs unfused.
        self.routed_wrapper: Callable[[RoutedSum, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Within `padding_rows` (a decode step's forward): which rows are a CUDA-graph bucket's padding, which the
        # routed form routes to no expert (no extra rows, passes or experts read for rows nobody reads).
        self.padding: Padding | None = None

    @staticmethod
    def projections(c: K3Config, residual: bool) -> list[Projection]:
        """`__call__`'s `linear_add` GEMMs on an unsharded rank (the GEMM of x's readers runs as F.linear)."""
        shared = c.moe_intermediate_size * c.num_shared_experts
        if c.uses_latent_moe:
            return [Projection("moe out (up|shared down)", c.hidden_size, c.routed_width + shared, residual)]
        # plain MoE: the shared down projection adds into the routed rows; the layer's residual comes after
        return [Projection("moe shared down", c.hidden_size, shared, True)] if shared else []

    def _expert_rows_dense(self, z: torch.Tensor, indices: torch.Tensor) -> ExpertRows:
        """Every expert on every token: [E*T, l] rows, token t's pick of expert e at row e*T + t."""
        gate_up, down = dense_form(z.shape[0]) if dispatch.use_triton(z) else ({}, None)  # references: no tuning
        act = dispatch.expert_gate_up_glu(z, self.w13, self.activation, self.config.situ_beta,
                                          self.config.situ_linear_beta, **gate_up)  # [E, T, F]
        out = torch.bmm(act, self.w2.transpose(1, 2)) if down is None else dispatch.expert_down(act, self.w2, **down)
        experts, tokens, width = out.shape
        return out.view(experts * tokens, width), indices, tokens, 1

    def _expert_rows_grouped(self, z: torch.Tensor, indices: torch.Tensor) -> ExpertRows:
        """Each (token, expert) pair once: rows sorted by expert, token t's j-th pick at row position[t, j]."""
        tokens, offsets, position = dispatch.moe_align(indices, self.w13.shape[0])
        gate_up = torch._grouped_mm(z[tokens], self.w13.transpose(1, 2), offs=offsets)
        out = torch._grouped_mm(glu_activation(self.config, gate_up), self.w2.transpose(1, 2), offs=offsets)
        return out, position, 1, 0

    def _expert_rows_routed(self, z: torch.Tensor, indices: torch.Tensor) -> ExpertRows:
        """The grouped form's rows (each pair once, sorted by expert) from one launch per projection; `padding`
        rows' pairs all read the zero row after them (their routed sum is 0: finite, read by no other row)."""
        padding = self.padding if self.padding is not None and self.padding[0].shape[0] == z.shape[0] else None
        act, position = dispatch.routed_expert_gate_up_glu(z, self.w13, indices, self.activation,
                                                           self.config.situ_beta, self.config.situ_linear_beta,
                                                           padding=padding)
        return dispatch.routed_expert_down(act, self.w2, indices, padding=padding), position, 1, 0

    def _routed(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dense: bool) -> torch.Tensor:
        """The routed sum [T, l] in float32 (the tensor a tensor-parallel rank all-reduces)."""
        rows, index, index_stride, token_stride = (self._expert_rows_dense if dense else self._expert_rows_grouped)(
            z, indices)
        return dispatch.moe_combine(rows, index, weights, index_stride, token_stride, out_dtype=weights.dtype)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) in one kernel (x cast only if the router weight is kept in
        another dtype than the model's, e.g. float32)."""
        moe = self.moe
        return dispatch.moe_route(x.to(self.router.dtype), self.router, moe.gate.e_score_correction_bias,
                                  moe.top_k, moe.renormalize, moe.scaling)

    def dense(self, tokens: int) -> bool:
        """Dense over all experts when every expert is likely touched anyway and the extra FLOPs stay under
        the weight reads (fewer, larger kernels); grouped for few tokens (few experts read) or many tokens."""
        experts = self.w13.shape[0]
        return not self.grouped or (tokens * self.moe.top_k >= 2 * experts and tokens <= DENSE_MAX_TOKENS)

    def routed(self, tokens: int) -> bool:
        """Whether the routed form runs at `tokens` rows (`K3_DENSE_EXPERTS=routed`, the default, in the dense range
        up to DENSE_MAX_TOKENS, unsharded)."""
        return (self.routed_wrapper is None and self.dense(tokens) and tokens <= DENSE_MAX_TOKENS
                and expert_form_name() == ROUTED_FORM)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        moe = self.moe
        # The router (latency-bound) beside the expert GEMMs: only the combine reads its output (a tensor-parallel
        # rank's routed wrapper needs it first).
        side = fork(x) if self.routed_wrapper is None else None
        by_route = self.routed(x.shape[0])
        with on(side):
            weights, indices = self._route(x)
        h = F.linear(x, self.in_weight) if self.in_weight is not None else None
        z = h[:, : self.width] if moe.latent else x
        shared_gate_up = h[:, self.width if moe.latent else 0 :] if self.shared_down is not None else None
        dense = self.dense(x.shape[0])
        if self.routed_wrapper is not None:
            routed = self.routed_wrapper(partial(self._routed, dense=dense), z, weights, indices)
            out = self._unfused_tail(routed.to(x.dtype), shared_gate_up)
            return out if residual is None else residual + out
        if not dense or by_route:  # the grouped and routed forms sort their rows by the routing
            join(side)
            side = None
        expert_rows = self._expert_rows_routed if by_route else \
            self._expert_rows_dense if dense else self._expert_rows_grouped
        rows, index, index_stride, token_stride = expert_rows(z, indices)
        join(side)
        norm = moe.routed_expert_norm if moe.latent else None
        tail = dispatch.moe_combine(rows, index, weights, index_stride, token_stride,
                                    None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps,
                                    shared_gate_up, self.activation, self.config.situ_beta,
                                    self.config.situ_linear_beta, out_dtype=x.dtype)
        if moe.latent:
            return linear_add(tail, self.out_weight, residual)
        out = tail if self.shared_down is None else \
            linear_add(tail[:, self.width :], self.shared_down, tail[:, : self.width])
        return out if residual is None else residual + out

    def _unfused_tail(self, routed: torch.Tensor, shared_gate_up: torch.Tensor | None) -> torch.Tensor:
        """The latent norm, up projection and shared experts after a routed sum in the model dtype."""
        moe = self.moe
        if moe.latent:
            if moe.routed_expert_norm is not None:
                routed = rms(moe.routed_expert_norm, routed)
            routed = moe.routed_expert_up_proj(routed)
        if shared_gate_up is not None:
            routed = linear_add(glu_activation(self.config, shared_gate_up), self.shared_down, routed)
        return routed
