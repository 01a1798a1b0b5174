"""Tensor parallelism inside one worker: one process per rank, torch.distributed (gloo on CPU, NCCL on GPU).

Every rank builds the full model and keeps only its shard, as k3core's sharding plan says:
- KDA: q/k/v/gate/decay projections, short convs, A_log, dt_bias split by head; each rank runs the
  recurrence of its own heads and holds only their states (its KDA pages carry those heads);
  o_proj is row-parallel, its partial outputs all-reduced.
- MLA: heads split (q_b_proj, kv_b_proj, output gate); the latent path is REPLICATED, so every rank caches
  the same latent (no split by tokens); o_proj row-parallel.
- MoE: each routed expert lives on one rank; the partial routed sums are all-reduced before the latent
  RMSNorm (a nonlinear step must see the full sum); shared experts and dense MLPs are column/row parallel.
- Embedding and LM head stay replicated here (the plan may split the vocabulary; logits are then
  identical on every rank and rank 0 samples without a gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3core.layers.kda import KimiDeltaAttention
from k3core.layers.mla import GatedMLA
from k3core.layers.moe import SparseMoE
from k3core.weights.sharding import EXPERT, SPLIT, shard_plan


class AllReduceOutput(nn.Module):
    """A row-parallel layer: each rank computes a partial sum of the output; the sum is all-reduced."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out, group=self.group)
        return out


class AllReduceInput(nn.Module):
    """Sums the ranks' partial inputs before a layer that needs the whole (the latent MoE norm)."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return self.inner(x)


class RemoteExpert(nn.Module):
    """An expert held by another rank: contributes nothing here (its owner adds it to the sum)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.width)


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, tp: int, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Cut a full model down to rank `rank` of `tp` in place and insert the collectives."""
    if tp == 1:
        return model
    config = model.config
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    plan = shard_plan(config, tp, shapes=shapes)
    for name, param in list(model.named_parameters()):
        spec = plan[name]
        if spec.kind == SPLIT and not name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.data = param.data[spec.index(rank, param.shape)].contiguous()
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.heads //= tp
            module.o_proj = AllReduceOutput(module.o_proj, group)
        elif isinstance(module, GatedMLA):
            module.heads //= tp
            module.o_proj = AllReduceOutput(module.o_proj, group)
        elif isinstance(module, SparseMoE):
            _shard_moe(module, plan, rank, group)
    for layer in model.model.layers:
        if not layer.is_moe:
            layer.mlp.down_proj = AllReduceOutput(layer.mlp.down_proj, group)
    return model


def _shard_moe(moe: SparseMoE, plan: dict, rank: int, group: dist.ProcessGroup | None) -> None:
    width = moe.experts[0].w2.weight.shape[0]
    # The plan gives expert e of every layer the same owner rank (ids are contiguous per rank).
    owner = {int(n.split(".experts.")[1].split(".")[0]): spec.owner
             for n, spec in plan.items() if spec.kind == EXPERT and n.endswith(".w1.weight")}
    for expert_id in range(len(moe.experts)):
        if owner[expert_id] != rank:
            moe.experts[expert_id] = RemoteExpert(width)
    if moe.latent:
        if moe.routed_expert_norm is not None:
            moe.routed_expert_norm = AllReduceInput(moe.routed_expert_norm, group)
        else:
            moe.routed_expert_up_proj = AllReduceInput(moe.routed_expert_up_proj, group)
        if moe.shared_experts is not None:
            moe.shared_experts.down_proj = AllReduceOutput(moe.shared_experts.down_proj, group)
    else:  # routed and shared partial sums add up before anything nonlinear: one all-reduce at the end
        moe.forward = _reduce_after(moe.forward, group)  # type: ignore[method-assign]


def _reduce_after(forward, group):
    def reduced(x: torch.Tensor) -> torch.Tensor:
        out = forward(x)
        dist.all_reduce(out, group=group)
        return out
    return reduced
