"""A tensor derived from module weights (e.g. stacked), rebuilt only when one of those weights changed.

A layer that hands a kernel its weights in another layout would otherwise pay an allocation and a copy per
forward call. A weight counts as changed when
- it was updated in place by an op autograd sees (an optimizer step, `load_state_dict`, `copy_` under
  no_grad): its version counter moved; or
- it was swapped (a new Parameter, `.data = ...`, `module.to(...)`): its storage moved.
The derivation keeps the weights it was built from referenced, so their storage cannot be freed and handed
to a later swapped-in weight at the same address. Not seen: writes through `.data` (that alias has its own
version counter), which no update path here uses.

Under autograd with a weight that requires grad, the tensor is built afresh on every call, so gradients
reach the weights (a training forward); so it is for inference tensors (weights created inside
`torch.inference_mode`), which have no version counter to follow. services/engine/derived_weights.py is
the decode fast path's counterpart: fixed storage for captured CUDA graphs, refreshed after a reload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Build = Callable[[Sequence[torch.Tensor]], torch.Tensor]
Identity = tuple[torch.device, int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _identity(weight: torch.Tensor) -> Identity:
    layout = (weight.dtype, tuple(weight.shape), weight.stride())
    return weight.device, weight.data_ptr(), *layout, weight._version


class WeightDerivation:
    def __init__(self, build: Build) -> None:
        self._build = build
        self._key: tuple[Identity, ...] = ()
        self._sources: tuple[torch.Tensor, ...] = ()  # pins the storage the key's addresses name
        self._value: torch.Tensor | None = None

    def get(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """`build(weights)`, from the cache when no weight changed since it was built."""
        if any(w.is_inference() for w in weights) or (
                torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
            return self._build(weights)
        key = tuple(_identity(w) for w in weights)
        if self._value is None or key != self._key:
            # A normal tensor even inside inference_mode: a later caller outside it may still use it.
            with torch.inference_mode(False), torch.no_grad():
                self._value = self._build(weights)
            self._key, self._sources = key, tuple(w.detach() for w in weights)
        return self._value
