"""A splitmix64-style integer mixer mod 2**63, elementwise on int64 tensors, bit-identical on every device.

torch has no uint64 arithmetic, so the mixer works mod 2**63: every int64 is masked to 63 bits after each
add or multiply (int64 products wrap mod 2**64 on CPU and CUDA alike, the mask keeps the low 63 bits), so
values stay non-negative and `>>` is a logical shift everywhere. Each step (xor-shift, multiply by an odd
constant) is a bijection of [0, 2**63), hence so is the whole mixer: distinct inputs give distinct outputs.
Used by the sampler's counter-based noise and by the cache's integrity checksum.
"""

from __future__ import annotations

import torch

MASK63 = (1 << 63) - 1
GOLDEN63 = 0x9E3779B97F4A7C15 & MASK63  # splitmix64's increment (the golden ratio), mod 2**63
# splitmix64's finaliser multipliers with the top bit cleared (still odd, so multiplying is a bijection)
_MUL_A = 0xBF58476D1CE4E5B9 & MASK63
_MUL_B = 0x94D049BB133111EB & MASK63


def position_keys(start: int, count: int, device: torch.device | str) -> torch.Tensor:
    """(i + 1) * GOLDEN63 mod 2**63 for i in [start, start + count): splitmix64's counter sequence."""
    keys = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device).mul_(GOLDEN63)
    return keys.bitwise_and_(MASK63)


def mix63_(x: torch.Tensor) -> torch.Tensor:
    """Mix int64 values in [0, 2**63) in place and return them (a bijection of [0, 2**63))."""
    x ^= x >> 30
    x.mul_(_MUL_A).bitwise_and_(MASK63)
    x ^= x >> 27
    x.mul_(_MUL_B).bitwise_and_(MASK63)
    x ^= x >> 31
    return x
