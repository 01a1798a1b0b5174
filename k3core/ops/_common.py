"""Small helpers shared by the functional ops: accumulation dtype, varlen bookkeeping, carried states."""

from __future__ import annotations

import torch


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype to accumulate in: at least float32, float64 when any input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence, for [B, T, ...] inputs with optional `cu_seqlens`.

    Without `cu_seqlens` every batch row is one sequence of length T. With it (fla convention) B must be 1
    and the rows of the single batch entry are N packed sequences.
    """
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got batch size {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={length}, got {bounds[0]}..{bounds[-1]}")
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def check_initial_state(initial_state: torch.Tensor | None, num_sequences: int, name: str) -> None:
    if initial_state is not None and initial_state.shape[0] != num_sequences:
        raise ValueError(f"{name} has {initial_state.shape[0]} rows but there are {num_sequences} sequences")


def start_state(
    initial_state: torch.Tensor | None, n: int, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor
) -> torch.Tensor:
    """Sequence n's carried state in `dtype`; zeros of `shape` (on `like`'s device) when none is given."""
    if initial_state is not None:
        return initial_state[n].to(dtype)
    return like.new_zeros(shape, dtype=dtype)
