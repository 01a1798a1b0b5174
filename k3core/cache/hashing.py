"""Chained prefix hashes over fine hash blocks, 64-bit fingerprints of cache bytes, and device checksums.

The hash of hash block i covers the hash of block i-1 and the token ids of block i, so one matching hash
certifies the whole prefix before its endpoint. BLAKE2b with an 8-byte digest is used for both the chain
and the transfer fingerprint: it is in the standard library, fast (about 1 GB/s on one core), and
collision-resistant enough that a 64-bit match can be trusted as prefix identity. The integrity checks of
cached entries use `checksum` instead: it runs where the bytes are (a GPU checkpoint needs no host copy and
no host hashing: BLAKE2b over a 13.5 MiB mini checkpoint cost ~38 ms on an H200 host, on every restore).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache

import torch

ROOT_HASH = 0


def block_hash(parent: int, token_bytes: bytes | memoryview) -> int:
    """The chain hash of one hash block: its parent's hash and its token ids as int64 bytes."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(token_bytes)
    return int.from_bytes(digest.digest(), "little")


def extend_chain(hashes: list[int], tokens: Sequence[int], hash_block: int, root: int = ROOT_HASH) -> None:
    """Append the hashes of every hash block of `tokens` that is full and not hashed yet. The new part is
    converted to int64 bytes once (the per-token conversion is most of the cost) and hashed in slices."""
    first, end = len(hashes) * hash_block, len(tokens) // hash_block * hash_block
    if end <= first:
        return
    part = tokens[first:end]
    raw = memoryview(part if isinstance(part, array) and part.typecode == "q" else array("q", part)).cast("B")
    step = 8 * hash_block
    parent = hashes[-1] if hashes else root
    for start in range(0, len(raw), step):
        parent = block_hash(parent, raw[start : start + step])
        hashes.append(parent)


def chain_hashes(tokens: Sequence[int], hash_block: int, root: int = ROOT_HASH) -> list[int]:
    hashes: list[int] = []
    extend_chain(hashes, tokens, hash_block, root)
    return hashes


def fingerprint(data: torch.Tensor) -> int:
    """64-bit fingerprint of the raw bytes of a (CPU) tensor."""
    raw = data.detach().contiguous().view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(raw.data, digest_size=8).digest(), "little")


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as int64 (torch has no uint64 arithmetic)
_MIX = 0xBF58476D1CE4E5B9 - (1 << 64)


@lru_cache(maxsize=16)
def _word_weights(num_words: int, device: torch.device) -> torch.Tensor:
    """Odd pseudo-random int64 weights, a splitmix64-style mix of the word index (the same on every device:
    int64 products wrap mod 2^64 and >> is arithmetic everywhere)."""
    z = torch.arange(1, num_words + 1, dtype=torch.int64, device=device) * _GOLDEN
    z = (z ^ (z >> 31)) * _MIX
    return (z ^ (z >> 29)) | 1


def checksum(data: torch.Tensor) -> int:
    """64-bit checksum of the raw bytes of a tensor, computed on its device: sum_i w_i * word_i mod 2^64 over
    its int64 words (zero-padded), with odd weights w_i, so any error within one word changes it. A product
    only carries bits upwards, so errors confined to high bits of several words cancel more easily: bit 63
    flips (the sign of an odd-indexed float32) cancel in pairs. For the integrity of cached entries (stray
    writes, bit flips), not for identity or against an adversary (the chain hashes and the transfer
    fingerprints are BLAKE2b)."""
    raw = data.detach().contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() % 8 or raw.storage_offset() % 8:
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)])  # a fresh, aligned copy
    words = raw.view(torch.int64)
    return int((words * _word_weights(words.numel(), words.device)).sum())
