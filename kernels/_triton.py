"""What every Triton launcher needs: Triton if installed, and small shape helpers.

CI has no GPU, so the kernels are exercised on the CPU through Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported); the launchers therefore use no autotuning and accept CPU tensors.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the plain-torch references serve every CPU caller without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def require(condition: bool, message: str) -> None:
    """Raise ValueError with a message naming the offending argument."""
    if not condition:
        raise ValueError(message)


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA device, for launch-shape rules; `cpu` stands in elsewhere (the
    interpreter), so each caller picks what its CPU tests should plan for."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else cpu
