"""Plain-Python big-integer oracles of `k3core.mix` (splitmix64's finaliser mod 2**63) and of what is built
on it: the sampler's noise bits and the cache's integrity checksum. Written from the definitions, independent
of the torch code under test."""

from __future__ import annotations

MOD = 1 << 63
GOLDEN, MUL_A, MUL_B = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(x: int) -> int:
    """splitmix64's finaliser mod 2**63, in Python integers."""
    x ^= x >> 30
    x = x * MUL_A % MOD
    x ^= x >> 27
    x = x * MUL_B % MOD
    return x ^ (x >> 31)


def noise_bits(key: int, column: int) -> int:
    """The sampler's hash of (token seed, vocab column): mix((key + (column + 1) * golden) mod 2**63)."""
    return mix((key + (column + 1) * GOLDEN) % MOD)


def checksum(data: bytes) -> int:
    """The definition: m_j = mix((u_j + (j + 1) * golden) mod 2**63) over the little-endian uint32 words u_j
    of the zero-padded bytes; A = sum m_j mod 2**63, B = xor m_j xor len(data); checksum = A * 2**63 + B."""
    padded = data + bytes(-len(data) % 4)
    total, folded = 0, len(data)
    for j in range(len(padded) // 4):
        m = mix((int.from_bytes(padded[4 * j : 4 * j + 4], "little") + (j + 1) * GOLDEN) % MOD)
        total, folded = (total + m) % MOD, folded ^ m
    return total * MOD + folded
