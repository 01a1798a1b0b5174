"""Save and strictly load K3 / Kimi Linear checkpoints, optionally MXFP4 experts and one TP rank's part.

Loading checks everything before reading any tensor data: every tensor the model needs is there,
nothing else is, every shape matches (MXFP4 tensors by the shape they decode to), and a missing,
unexpected or mis-shaped tensor produces ONE error listing all of them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from k3core.quant import mxfp4
from k3core.weights import hf_layout
from k3core.weights.errors import CheckpointError, CheckpointMismatchError
from k3core.weights.quant_config import PACKED_SUFFIX, SCALE_SUFFIX, MxQuantConfig, logical_weight_name
from k3core.weights.sharding import ShardPlanError, ShardSpec

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the Hugging Face default


@dataclass
class LoadedCheckpoint:
    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]  # config.json as written (K3Config.from_hf_dict reads it)
    quantization: MxQuantConfig | None


def _config_dict(config: Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, Mapping) else config.to_hf_dict()


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], quant: MxQuantConfig) -> dict[str, torch.Tensor]:
    """Replace each targeted ``X.weight`` by ``X.weight_packed`` + ``X.weight_scale``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or tensor.ndim != 2 or not tensor.is_floating_point() or not quant.quantizes(module):
            out[name] = tensor
            continue
        if tensor.shape[-1] % quant.group_size:
            raise CheckpointError(f"{name}: in-dim {tensor.shape[-1]} is not a multiple of {quant.group_size} (MXFP4)")
        out[module + PACKED_SUFFIX], out[module + SCALE_SUFFIX] = mxfp4.quantize(tensor, quant.group_size)
    return out


def save_checkpoint(
    directory: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    *,
    quantization: MxQuantConfig | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``state_dict`` in Hugging Face layout; ``config`` is a K3Config or a config.json dict."""
    config_out = _config_dict(config)
    tensors = _untie(dict(state_dict), config_out)
    tensors = quantize_state_dict(tensors, quantization) if quantization else tensors
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in _without_aliases(tensors).items()}
    has_packed = any(n.endswith(PACKED_SUFFIX) for n in tensors)
    if has_packed:
        if quantization is None:
            raise CheckpointError("state dict holds MXFP4 tensors: pass quantization= to record it in config.json")
        config_out["quantization_config"] = quantization.to_hf_dict()
    hf_layout.write_files(Path(directory), hf_layout.group_into_files(tensors, max_shard_bytes), config_out)


def _untie(tensors: dict[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """With ``tie_word_embeddings`` the lm_head is the embedding and is not stored, even when the caller
    cloned it into a separate tensor; a head that differs from the embedding is refused, not dropped."""
    tied = config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings")
    head, emb = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if not tied or head is None or emb is None:
        return tensors
    if not torch.equal(head, emb):
        raise CheckpointError("config ties lm_head to embed_tokens but the state dict holds different values")
    return {n: t for n, t in tensors.items() if n != "lm_head.weight"}


def _without_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of the same storage (tied lm_head): as in Hugging Face checkpoints, the tie is
    recorded by ``tie_word_embeddings`` in config.json, not by a second copy."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _logical_shapes(
    shapes: Mapping[str, tuple[int, ...]], group: int
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Map stored tensors to the tensors they stand for: MXFP4 pairs become ``X.weight``."""
    logical: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []
    for name, shape in shapes.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] + PACKED_SUFFIX not in shapes:
                problems.append(f"{name} without its {PACKED_SUFFIX}")
            continue
        if not name.endswith(PACKED_SUFFIX):
            logical[name] = shape
            continue
        module = name[: -len(PACKED_SUFFIX)]
        scale = shapes.get(module + SCALE_SUFFIX)
        full = (*shape[:-1], shape[-1] * 2)
        if scale is None:
            problems.append(f"{name} without its {SCALE_SUFFIX}")
        elif tuple(scale) != (*shape[:-1], full[-1] // group):
            problems.append(f"{module + SCALE_SUFFIX}: shape {list(scale)} does not fit packed {list(shape)}")
        logical[module + ".weight"] = full
    return logical, problems


def check_against_model(
    expected: Mapping[str, Sequence[int]], found: Mapping[str, Sequence[int]], where: str
) -> None:
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    mismatched = [(n, tuple(expected[n]), tuple(found[n])) for n in expected if n in found and tuple(expected[n]) != tuple(found[n])]
    if missing or unexpected or mismatched:
        raise CheckpointMismatchError(missing, unexpected, mismatched, where=where)


def load_checkpoint(
    directory: str | Path,
    *,
    expected: Mapping[str, Sequence[int]] | None = None,
    plan: Mapping[str, ShardSpec] | None = None,
    rank: int = 0,
    dequantize: bool = True,
    dtype: torch.dtype | None = None,
    skip: Sequence[str] = (),
) -> LoadedCheckpoint:
    """Read a checkpoint. ``expected``: the model's full tensor shapes (strict check; omit to read as is).
    ``plan`` + ``rank``: read only that rank's slices (expert tensors only on their owner).
    ``dequantize=False`` keeps MXFP4 experts packed (for a kernel that consumes them).
    ``dtype`` casts floating-point tensors (never the packed uint8 ones).
    ``skip``: regexes of stored tensors deliberately left out (e.g. a vision tower or an MTP head),
    neither read nor reported as unexpected."""
    directory = Path(directory)
    config = hf_layout.read_config(directory)
    skipped = [re.compile(p) for p in skip]
    weight_map = {
        n: f for n, f in hf_layout.read_weight_map(directory).items() if not any(p.match(n) for p in skipped)
    }
    shapes = _stored_shapes(directory, weight_map)
    quant = _quantization(config, shapes, directory)
    logical, problems = _logical_shapes(shapes, quant.group_size if quant else mxfp4.BLOCK)
    if problems:
        raise CheckpointError(f"{directory}: broken MXFP4 tensors:\n  " + "\n  ".join(problems))
    if expected is not None:
        check_against_model(expected, logical, str(directory))
    if plan is not None and set(plan) != set(logical):
        raise CheckpointMismatchError(
            set(plan) - set(logical), set(logical) - set(plan), where=f"{directory} (against the shard plan)"
        )
    stored = _read(directory, weight_map, shapes, plan, rank)
    return LoadedCheckpoint(_finish(stored, dequantize, dtype), config, quant)


def _names_by_file(weight_map: Mapping[str, str]) -> dict[str, list[str]]:
    """Each shard file once, with the tensors to take from it (a file is opened once, not per tensor)."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in weight_map.items():
        by_file[file].append(name)
    return by_file


def _stored_shapes(directory: Path, weight_map: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file, names in _names_by_file(weight_map).items():
        with safe_open(directory / file, framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return {name: shapes[name] for name in weight_map}


def _quantization(config: Mapping[str, Any], shapes: Mapping[str, Any], directory: Path) -> MxQuantConfig | None:
    raw = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    packed = any(n.endswith(PACKED_SUFFIX) for n in shapes)
    if raw is None:
        if packed:
            raise CheckpointError(f"{directory}: MXFP4 tensors present but config.json has no quantization_config")
        return None
    return MxQuantConfig.from_hf_dict(raw)


def _read(
    directory: Path,
    weight_map: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]],
    plan: Mapping[str, ShardSpec] | None,
    rank: int,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file, names in _names_by_file(weight_map).items():
        with safe_open(directory / file, framework="pt") as f:
            for name in names:
                if plan is None:
                    out[name] = f.get_tensor(name)
                    continue
                spec = plan[logical_weight_name(name)]
                if not spec.on_rank(rank):
                    continue
                if spec.dim is not None and shapes[name][spec.dim] % spec.parts:
                    raise ShardPlanError(f"{name}: stored shape {list(shapes[name])} does not split {spec.parts} ways")
                # Only this rank's bytes are read from disk.
                out[name] = f.get_slice(name)[spec.index(rank, shapes[name])]
    return {name: out[name] for name in weight_map if name in out}


def _finish(stored: dict[str, torch.Tensor], dequantize: bool, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE_SUFFIX) and dequantize:
            continue
        if name.endswith(PACKED_SUFFIX) and dequantize:
            module = name[: -len(PACKED_SUFFIX)]
            out[module + ".weight"] = mxfp4.dequantize(tensor, stored[module + SCALE_SUFFIX], dtype or torch.bfloat16)
        elif dtype is not None and tensor.is_floating_point():
            out[name] = tensor.to(dtype)
        else:
            out[name] = tensor
    return out


def load_into(module: torch.nn.Module, directory: str | Path, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Strictly load a checkpoint into a whole (unsharded) model; returns config.json. Tied tensors
    are expected once, under their first name."""
    own = _without_aliases(module.state_dict())
    loaded = load_checkpoint(directory, expected={n: tuple(t.shape) for n, t in own.items()}, dtype=dtype)
    with torch.no_grad():
        for name, tensor in loaded.state_dict.items():
            own[name].copy_(tensor)
    return loaded.config
