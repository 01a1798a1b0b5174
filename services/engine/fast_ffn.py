"""Feed-forward of the decode fast path: gated MLPs with one gate|up GEMM, and the latent MoE as grouped
GEMMs over the routed (token, expert) pairs sorted by expert (no per-expert loop, no host sync).

Routed experts: pairs are sorted by expert id, the tokens' latent rows gathered once, and
`torch._grouped_mm` runs every expert's gate|up and down matmul over its contiguous run of rows (the
expert weights are stacked once into [E, 2F, l] and [E, l, F]; the modules' weights become views of
them). Where grouped matmul is not available, the same pairs run as a dense batched matmul over all
experts (exact too, more FLOPs): also the choice where nearly every expert is read anyway and the
extra FLOPs stay under the weight reads (a mid-size batch), because it is a handful of large kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.config import K3Config
from k3core.layers.mlp import GatedMLP
from k3core.layers.moe import SparseMoE
from k3core.ops.moe import sigmoid_router, swiglu
from kernels import dispatch
from services.engine.derived_weights import DerivedWeights
from services.engine.fast_attention import fuse_linears, rms


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(glu_activation(self.config, F.linear(x, self.gate_up)))


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here (CUDA: Hopper+ in recent torch; CPU: a reference fallback)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(2, 16, dtype=dtype, device=device)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


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
        self.shared = MlpDecode(moe.shared_experts, config) if moe.shared_experts is not None else None
        # Routing runs in float32 (MoEGate): cast once here (the weight itself in a float32 model).
        self.router = self.derived.derive(lambda: moe.gate.weight.float())

    def _routed_grouped(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        tokens, top_k = indices.shape
        experts = self.w13.shape[0]
        flat = indices.reshape(-1)
        # A unique key per pair keeps the order deterministic without a stable (radix) sort: the plain sort
        # of a few thousand keys is one bitonic pass.
        keys = flat * flat.numel() + torch.arange(flat.numel(), device=z.device)
        order = torch.sort(keys).indices
        counts = torch.zeros(experts, dtype=torch.int32, device=z.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        token_of = order // top_k
        rows = z[token_of]
        gate_up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offsets)
        out = torch._grouped_mm(glu_activation(self.config, gate_up), self.w2.transpose(1, 2), offs=offsets)
        out = out.to(weights.dtype) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros(tokens, z.shape[1], dtype=weights.dtype, device=z.device).index_add_(0, token_of, out)

    def _routed_dense(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        experts = self.w13.shape[0]
        gate_up = torch.matmul(z.unsqueeze(0), self.w13.transpose(1, 2))  # [E, T, 2F]
        out = torch.matmul(glu_activation(self.config, gate_up), self.w2.transpose(1, 2))  # [E, T, l]
        dense = torch.zeros(z.shape[0], experts, dtype=weights.dtype, device=z.device).scatter_(1, indices, weights)
        return torch.einsum("te,etl->tl", dense, out.to(weights.dtype))

    def _dense(self, tokens: int) -> bool:
        """Dense over all experts when every expert is likely touched anyway and the extra FLOPs stay under
        the weight reads (fewer, larger kernels); grouped for few tokens (few experts read) or many tokens."""
        experts = self.w13.shape[0]
        return not self.grouped or (tokens * self.moe.top_k >= 2 * experts and tokens <= 128)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        logits = F.linear(x.float(), self.router)
        weights, indices = sigmoid_router(logits, moe.top_k, moe.gate.e_score_correction_bias, moe.renormalize,
                                          moe.scaling)
        z = moe.routed_expert_down_proj(x) if moe.latent else x
        routed = (self._routed_dense if self._dense(x.shape[0]) else self._routed_grouped)(z, weights, indices)
        routed = routed.to(x.dtype)
        if moe.latent:
            if moe.routed_expert_norm is not None:
                routed = rms(moe.routed_expert_norm, routed)
            routed = moe.routed_expert_up_proj(routed)
        if self.shared is not None:
            routed = routed + self.shared(x)
        return routed
