"""Hugging Face checkpoint layout: config.json + model-0000i-of-0000N.safetensors + index json."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3core.weights.errors import CheckpointError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_into_files(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, order-preserving split into files of at most ``max_shard_bytes`` (a bigger tensor gets
    a file of its own)."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if files[-1] and size + _nbytes(tensor) > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += _nbytes(tensor)
    return files


def write_files(directory: Path, files: list[dict[str, torch.Tensor]], config: dict) -> None:
    """Write shards, then the index, then config.json; each via a temporary name and an atomic rename,
    so a reader that finds the index finds complete shards."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(files):
        name = shard_file_name(i, len(files))
        _atomic(directory / name, lambda tmp, t=tensors: save_file(t, tmp, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(_nbytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _atomic(directory / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2) + "\n"))
    _atomic(directory / CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


def read_config(directory: Path) -> dict:
    path = directory / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def read_weight_map(directory: Path) -> dict[str, str]:
    """name -> file, checked against what the files really hold (all disagreements in one error)."""
    index_path = directory / INDEX
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from exc
    elif (directory / SINGLE).exists():
        with safe_open(directory / SINGLE, framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE)
    else:
        raise CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE} found")
    problems = []
    for file in sorted(set(weight_map.values())):
        path = directory / file
        if not path.exists():
            problems.append(f"{file}: listed in the index but missing")
            continue
        with safe_open(path, framework="pt") as f:
            held = set(f.keys())
        listed = {n for n, where in weight_map.items() if where == file}
        problems += [f"{file}: holds {n} which the index does not list there" for n in sorted(held - listed)]
        problems += [f"{file}: lacks {n} which the index puts there" for n in sorted(listed - held)]
    if problems:
        raise CheckpointError(f"{directory}: index and shards disagree:\n  " + "\n  ".join(problems))
    return weight_map
