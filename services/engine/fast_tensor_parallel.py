"""The decode fast path of one tensor-parallel rank (TP > 1).

`shard_model` cut the model to this rank's shard and wrapped its row-parallel layers in collectives
(`AllReduceOutput`, `AllReduceInput`) and the other ranks' experts in `RemoteExpert`. The fast path's layer
forms read module weights directly (fused GEMMs, stacked experts), so they are built on a *local view* of
the model instead: the same modules and parameter tensors, minus the collective wrappers and the remote
experts. The all-reduces are then inserted around the fast forms, on the tensors the reference TP forward
reduces, in the same order:
- attention (KDA and MLA): the output of o_proj (row parallel over this rank's heads);
- dense MLP: the output of down_proj;
- latent MoE: the routed partial sum, in the model dtype, before the latent norm / up projection; then the
  shared experts' down_proj output. Plain MoE: routed + shared, once, at the end.
With NCCL a collective is one more kernel in the captured CUDA graph (every rank captures and replays the
same bucket in the same step, since every rank runs the same plan); gloo on the CPU runs eagerly.

Pool: a rank's pool is laid out for its own heads (`rank_layout`), so `PoolViews` over it address exactly
this rank's KDA heads' byte ranges; MLA latents are replicated and every rank writes the same rows.

Experts: the plan gives each rank a contiguous range of expert ids; the router is replicated and picks
global ids. A pair routed to another rank's expert goes, with weight 0, to a zero "sentinel" expert appended
to the local stack: shapes stay static (CUDA graphs) and no host sync drops the pairs. The extra FLOPs are
the remote pairs' rows through one zero expert, whose weights are read once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from k3core.cache.pool_views import PoolViews
from k3core.model import K3Model
from services.engine.fast_decoder import FastDecoder
from services.engine.fast_ffn import MlpDecode, MoeDecode, RoutedSum
from services.engine.tensor_parallel import AllReduceInput, AllReduceOutput, RemoteExpert

_COLLECTIVES = (AllReduceOutput, AllReduceInput)


def _collective(model: nn.Module) -> AllReduceOutput | AllReduceInput | None:
    """A collective wrapper of a sharded model (every one holds the rank's group); None at TP 1."""
    return next((m for m in model.modules() if isinstance(m, _COLLECTIVES)), None)


def rank_decoder(model: K3Model, views: PoolViews) -> FastDecoder:
    """The fast decoder of this rank's model: the plain one at TP 1, the sharded one after `shard_model`."""
    collective = _collective(model)
    if collective is None:
        return FastDecoder(model, views)
    return sharded_decoder(model, views, collective.group)


def graph_capturable(model: K3Model, opted_in: bool = False) -> bool:
    """Whether this rank's decode forward may be captured in a CUDA graph: no collectives, or NCCL ones
    (a gloo collective on CUDA tensors waits on the host, which a capture forbids) when the operator asks
    for them (`opted_in`: decode_fastpath's K3_DECODE_CUDA_GRAPHS=1): torch captures NCCL collectives, but
    this path has not been run on multi-GPU hosts yet, so a TP > 1 worker replays eagerly unless told so."""
    collective = _collective(model)
    if collective is None:
        return True
    return dist.get_backend(collective.group) == dist.Backend.NCCL and opted_in


def sharded_decoder(model: K3Model, views: PoolViews, group: dist.ProcessGroup | None) -> FastDecoder:
    """FastDecoder over the local view of a sharded model, its attention and feed-forward forms wrapped in
    the reference TP forward's all-reduces."""
    local = local_view(model)
    decoder = FastDecoder(local, views)
    decoder.attention = [reduced(op, group) for op in decoder.attention]
    for i, layer in enumerate(model.model.layers):
        if not layer.is_moe:
            decoder.ffn[i] = reduced(decoder.ffn[i], group)
            continue
        moe = layer.block_sparse_moe
        shared = MlpDecode(_without_collectives(moe.shared_experts), local.config) \
            if moe.shared_experts is not None else None
        decoder.ffn[i] = ShardedMoe(decoder.ffn[i], expert_range(moe), shared, group)
    return decoder


def all_reduced(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def reduced(op: Callable[..., torch.Tensor], group: dist.ProcessGroup | None) -> Callable[..., torch.Tensor]:
    """`op` whose output (a row-parallel layer's partial sum) is all-reduced. A `residual` the caller wants
    added is added after the sum, not inside `op` (where every rank would add it: tp times in all)."""
    def run(*args, residual: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        out = all_reduced(op(*args, **kwargs), group)
        return out if residual is None else residual + out
    return run


def expert_range(moe: nn.Module) -> range:
    """The global ids of this rank's experts (the plan gives every rank a contiguous range)."""
    ids = [i for i, e in enumerate(moe.experts) if not isinstance(e, RemoteExpert)]
    if not ids or ids != list(range(ids[0], ids[-1] + 1)):
        raise ValueError(f"this rank's experts {ids} are not one contiguous range of ids")
    return range(ids[0], ids[-1] + 1)


class ShardedMoe:
    """A rank's share of an MoE layer: routes over every expert, runs its own (other ranks' pairs go to the
    zero sentinel with weight 0), and all-reduces where the reference TP forward does."""

    def __init__(self, inner: MoeDecode, experts: range, shared: MlpDecode | None,
                 group: dist.ProcessGroup | None) -> None:
        if inner.w13.shape[0] != len(experts) + 1:
            raise ValueError("the local MoE view must stack this rank's experts and one sentinel")
        self.inner, self.experts, self.shared, self.group = inner, experts, shared, group
        self.latent = inner.moe.latent
        # The routed sum is the one tensor reduced inside MoeDecode's forward.
        inner.routed_wrapper = self._local

    def _local(self, routed: RoutedSum, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`routed` over this rank's experts only (the others' pairs: weight 0 on the sentinel)."""
        first, count = self.experts.start, len(self.experts)
        local = indices - first
        mine = (local >= 0) & (local < count)
        out = routed(z, torch.where(mine, weights, 0.0), torch.where(mine, local, count))
        # Latent: the reference reduces the routed sum cast to the model dtype, before the norm.
        return all_reduced(out.to(z.dtype), self.group) if self.latent else out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.inner(x)
        if self.latent:
            out = out if self.shared is None else out + all_reduced(self.shared(x), self.group)
        else:
            out = all_reduced(out if self.shared is None else out + self.shared(x), self.group)
        return out if residual is None else residual + out


def local_view(model: K3Model) -> K3Model:
    """The model as this rank computes it without collectives: a structural copy sharing every module and
    parameter, with the collective wrappers replaced by the layers they wrap, only this rank's experts (plus
    the zero sentinel) and no shared experts (the sharded MoE runs them). The model itself is unchanged."""
    layers = [_local_layer(layer) for layer in model.model.layers]
    return _shallow(model, model=_shallow(model.model, layers=nn.ModuleList(layers)))


def _local_layer(layer: nn.Module) -> nn.Module:
    children = {"self_attn": _without_collectives(layer.self_attn)}
    if layer.is_moe:
        children["block_sparse_moe"] = _local_moe(layer.block_sparse_moe)
    else:
        children["mlp"] = _without_collectives(layer.mlp)
    return _shallow(layer, **children)


def _local_moe(moe: nn.Module) -> nn.Module:
    mine = [moe.experts[i] for i in expert_range(moe)]
    sentinel = copy.deepcopy(mine[0])
    with torch.no_grad():
        for weight in sentinel.parameters():
            weight.zero_()
    local = _without_collectives(moe, experts=nn.ModuleList([*mine, sentinel]), shared_experts=None)
    local.__dict__.pop("forward", None)  # the plain MoE's reduce-after forward (shard_model) is not ours
    return local


def _without_collectives(module: nn.Module, **children: nn.Module | None) -> nn.Module:
    """`_shallow(module)` with every direct child that is a collective wrapper replaced by what it wraps."""
    unwrapped = {name: child.inner for name, child in module._modules.items()
                 if isinstance(child, _COLLECTIVES)}
    return _shallow(module, **unwrapped, **children)


def _shallow(module: nn.Module, **children: nn.Module | None) -> nn.Module:
    """A copy of `module` sharing its parameters, attributes and children, except `children` replaced; the
    copy has its own child table, so the original keeps its children."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for name, child in children.items():
        setattr(clone, name, child)
    return clone
