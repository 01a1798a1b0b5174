"""Checkpoint I/O (Hugging Face layout, Kimi Linear + K3 names, MXFP4 experts) and the TP sharding plan."""

from k3core.weights.checkpoint import (
    LoadedCheckpoint,
    check_against_model,
    load_checkpoint,
    load_into,
    quantize_state_dict,
    save_checkpoint,
)
from k3core.weights.errors import CheckpointError, CheckpointMismatchError
from k3core.weights.quant_config import K3_IGNORE, MxQuantConfig
from k3core.weights.sharding import (
    ShardPlanError,
    ShardSpec,
    merge_shards,
    model_tensor_shapes,
    shard_plan,
    shard_state_dict,
)

__all__ = [
    "K3_IGNORE",
    "CheckpointError",
    "CheckpointMismatchError",
    "LoadedCheckpoint",
    "MxQuantConfig",
    "ShardPlanError",
    "ShardSpec",
    "check_against_model",
    "load_checkpoint",
    "load_into",
    "merge_shards",
    "model_tensor_shapes",
    "quantize_state_dict",
    "save_checkpoint",
    "shard_plan",
    "shard_state_dict",
]
