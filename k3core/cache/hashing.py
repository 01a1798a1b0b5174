"""Chained prefix hashes over fine hash blocks, and 64-bit fingerprints of cache bytes.

The hash of hash block i covers the hash of block i-1 and the token ids of block i, so one matching hash
certifies the whole prefix before its endpoint. BLAKE2b with an 8-byte digest is used for both: it is in
the standard library, fast (about 1 GB/s on one core), and collision-resistant enough that a 64-bit match
can be trusted as prefix identity.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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
