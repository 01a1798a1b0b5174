"""Tensors the decode fast path derives from module weights (stacked, transposed, cast), kept refreshable.

A derived tensor is built once and must keep its storage afterwards: CUDA graphs captured its address. So a
weight reload (`load_state_dict` copies into the parameters in place) is followed by `refresh()`, which
rebuilds every derived tensor from the current weights and copies the result into the existing storage.
Views of module weights (fused projections, stacked experts) are not registered: the in-place load
already writes through them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Build = Callable[[], torch.Tensor]


class DerivedWeights:
    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, Build]] = []

    def __len__(self) -> int:
        return len(self._entries)

    @torch.no_grad()
    def derive(self, build: Build) -> torch.Tensor:
        """`build()`'s tensor, recorded with its recipe for `refresh`."""
        tensor = build()
        self._entries.append((tensor, build))
        return tensor

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute every derived tensor from the modules' current weights, in place."""
        for tensor, build in self._entries:
            fresh = build()
            if fresh.shape != tensor.shape or fresh.dtype != tensor.dtype:
                raise ValueError(f"a derived weight changed from {tuple(tensor.shape)} {tensor.dtype} "
                                 f"to {tuple(fresh.shape)} {fresh.dtype}: a reload must keep every shape")
            if fresh.data_ptr() != tensor.data_ptr():  # a recipe that returns the weight itself needs no copy
                tensor.copy_(fresh)
