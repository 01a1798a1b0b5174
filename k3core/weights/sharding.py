"""Tensor-parallel sharding plan: for every tensor, split (which dim), replicate, or expert-owned."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3core.weights import shard_rules as rules
from k3core.weights.errors import CheckpointError
from k3core.weights.quant_config import logical_weight_name

REPLICATE, SPLIT, EXPERT = "replicate", "split", "expert"


class ShardPlanError(CheckpointError):
    """Tensors that have no sharding rule or do not divide across the ranks (all listed)."""


@dataclass(frozen=True)
class ShardSpec:
    kind: str  # REPLICATE | SPLIT | EXPERT
    parts: int  # tensor-parallel size
    dim: int | None = None  # SPLIT: the dim cut into `parts` equal contiguous pieces
    owner: int | None = None  # EXPERT: the one rank that holds the whole tensor

    def on_rank(self, rank: int) -> bool:
        return self.kind != EXPERT or self.owner == rank

    def index(self, rank: int, shape: Sequence[int]) -> tuple[slice, ...]:
        """What ``rank`` holds of a tensor of full ``shape`` (everything unless SPLIT)."""
        if self.kind != SPLIT:
            return tuple(slice(None) for _ in shape)
        assert self.dim is not None
        step = shape[self.dim] // self.parts
        return tuple(slice(rank * step, (rank + 1) * step) if d == self.dim else slice(None) for d in range(len(shape)))


def model_tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of the model ``config`` describes (no instantiation,
    so it works for the 2.8T-parameter k3 preset too)."""
    from k3core.model.parameters import parameter_shapes  # the model package owns the names

    return parameter_shapes(config)


def shard_plan(
    config: Any, tp_size: int, *, shapes: Mapping[str, Sequence[int]] | None = None
) -> dict[str, ShardSpec]:
    """The layout of every tensor over ``tp_size`` ranks. ``shapes`` (name -> full shape) defaults to
    the model built from ``config``; pass a checkpoint's shapes to plan for MXFP4-packed tensors."""
    if tp_size < 1:
        raise ShardPlanError(f"tp_size must be >= 1, got {tp_size}")
    shapes = dict(shapes) if shapes is not None else model_tensor_shapes(config)
    # MXFP4 parts follow the rule of the weight they encode.
    kinds = {name: rules.rule_for(logical_weight_name(name)) for name in shapes}
    experts_per_layer: dict[str, set[int]] = defaultdict(set)
    for name, kind in kinds.items():
        if kind == rules.EXPERT:
            experts_per_layer[name.split(".experts.")[0]].add(rules.expert_id(name))
    plan: dict[str, ShardSpec] = {}
    problems = _head_problems(config, tp_size, shapes)
    for name, shape in shapes.items():
        kind = kinds[name]
        if kind is None:
            problems.append(f"{name}: no sharding rule (add one to k3core/weights/shard_rules.py)")
            continue
        if kind == rules.EXPERT:
            count = len(experts_per_layer[name.split(".experts.")[0]])
            if count % tp_size:
                problems.append(f"{name}: {count} experts do not divide over {tp_size} ranks")
                continue
            plan[name] = ShardSpec(EXPERT, tp_size, owner=rules.expert_id(name) // (count // tp_size))
            continue
        dim = {rules.SPLIT_OUT: 0, rules.SPLIT_IN: 1, rules.VOCAB: 0}.get(kind)
        if kind == rules.SPLIT_HEADS:
            dim = max(range(len(shape)), key=lambda d: shape[d])
        if kind == rules.REPLICATE or tp_size == 1 or (kind == rules.VOCAB and shape[0] % tp_size):
            plan[name] = ShardSpec(REPLICATE, tp_size)
        elif dim is None or dim >= len(shape) or shape[dim] % tp_size:
            problems.append(f"{name}: shape {list(shape)} does not split over {tp_size} ranks on dim {dim}")
        else:
            plan[name] = ShardSpec(SPLIT, tp_size, dim=dim)
    if problems:
        raise ShardPlanError(f"no valid tensor-parallel plan for tp={tp_size}:\n  " + "\n  ".join(problems))
    return plan


def _head_problems(config: Any, tp_size: int, shapes: Mapping[str, Any]) -> list[str]:
    """Attention splits must fall between heads, not just divide the element count."""
    problems = []
    for field, marker in (("kda_num_heads", ".A_log"), ("num_attention_heads", ".kv_b_proj.")):
        heads = getattr(config, field, None)
        if heads and tp_size > 1 and heads % tp_size and any(marker in n for n in shapes):
            problems.append(f"config.{field}={heads} does not divide over {tp_size} ranks")
    return problems


def _check_names(names: set[str], plan: Mapping[str, ShardSpec]) -> None:
    missing = sorted(set(plan) - names)
    extra = sorted(names - set(plan))
    if missing or extra:
        raise ShardPlanError(f"state dict and plan disagree: not in state dict {missing}, not in plan {extra}")


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor], plan: Mapping[str, ShardSpec], rank: int
) -> dict[str, torch.Tensor]:
    """The part of a full state dict that ``rank`` holds (its own contiguous copies)."""
    _check_names(set(state_dict), plan)
    out = {}
    for name, tensor in state_dict.items():
        spec = plan[name]
        if not 0 <= rank < spec.parts:
            raise ShardPlanError(f"rank {rank} outside tp_size {spec.parts}")
        if spec.on_rank(rank):
            out[name] = tensor[spec.index(rank, tensor.shape)].contiguous()
    return out


def merge_shards(shards: Sequence[Mapping[str, torch.Tensor]], plan: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_state_dict` over all ranks (for publishing trained weights)."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in plan.items():
        if spec.kind == SPLIT:
            out[name] = torch.cat([shard[name] for shard in shards], dim=spec.dim)
        elif spec.kind == EXPERT:
            out[name] = shards[spec.owner][name]  # type: ignore[index]
        else:
            first = shards[0][name]
            if any(not torch.equal(first, shard[name]) for shard in shards[1:]):
                raise ShardPlanError(f"replicated tensor {name} differs between ranks")
            out[name] = first
    return out
