"""A device tensor's copy to the host, queued behind the work that produces it, waited for only when read."""

from __future__ import annotations

import torch


class HostCopy:
    """On CUDA: a non-blocking copy into pinned host memory and an event recorded behind it (no sync now);
    on the CPU the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = tensor
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (waits for the device only if it has not yet)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
