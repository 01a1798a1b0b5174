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

import torch

from k3core.mix import MASK63, mix63_, position_keys

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


# words per chunk: the peak temporaries are ~16 bytes per chunk word (0.5 MiB on CPU, 32 MiB on a GPU)
_CPU_CHUNK_WORDS, _DEVICE_CHUNK_WORDS = 1 << 15, 1 << 21


def checksum_lanes(data: torch.Tensor, chunk_words: int | None = None) -> torch.Tensor:
    """The two 63-bit lanes of `checksum`, as an int64 tensor [2] on the data's device (no host sync)."""
    raw = data.detach().contiguous().view(torch.uint8).reshape(-1)
    nbytes = raw.numel()
    step = 4 * (chunk_words or (_CPU_CHUNK_WORDS if raw.device.type == "cpu" else _DEVICE_CHUNK_WORDS))
    total = raw.new_zeros((), dtype=torch.int64)
    folded = raw.new_zeros((), dtype=torch.int64)
    for start in range(0, nbytes, step):
        part = raw[start : start + step]
        if part.numel() % 4 or part.storage_offset() % 4:
            part = torch.cat([part, part.new_zeros(-part.numel() % 4)])  # an aligned copy of one chunk
        words = part.view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)  # little-endian uint32
        mixed = mix63_(words.add_(position_keys(start // 4, words.numel(), words.device)).bitwise_and_(MASK63))
        total = total + mixed.sum()  # int64 sums wrap mod 2**64 on every device; masked below
        folded = folded ^ _xor_all(mixed)
    return torch.stack([total & MASK63, folded ^ nbytes])


def _xor_all(x: torch.Tensor) -> torch.Tensor:
    """XOR of a non-empty 1-D int64 tensor as a 0-d tensor (torch has no xor reduction): halve and fold."""
    while x.numel() > 1:
        half = x.numel() // 2
        head = x[:half] ^ x[half : 2 * half]
        if x.numel() % 2:
            head[:1] ^= x[-1:]
        x = head
    return x.reshape(())


def lanes_to_int(lanes: list[int]) -> int:
    return lanes[0] << 63 | lanes[1]


def checksums(tensors: Sequence[torch.Tensor], chunk_words: int | None = None) -> list[int]:
    """`checksum` of each tensor, with one host sync for all of them (the lanes are computed on each
    tensor's device, stacked, and copied to the host together)."""
    if not tensors:
        return []
    lanes = torch.stack([checksum_lanes(t, chunk_words).to(tensors[0].device) for t in tensors])
    return [lanes_to_int(pair) for pair in lanes.tolist()]


def checksum(data: torch.Tensor, chunk_words: int | None = None) -> int:
    """126-bit integrity checksum of the raw bytes of a tensor, computed on its device. The bytes, zero-padded
    to whole little-endian uint32 words u_j, are mixed one word at a time, m_j = mix63((u_j + (j + 1) *
    GOLDEN63) mod 2**63) (`k3core.mix`, a bijection of 63-bit values), and combined in two lanes:
    A = sum_j m_j mod 2**63 and B = xor_j m_j xor len(bytes); the checksum is A * 2**63 + B.
    Guarantee: any change within one aligned 32-bit word (any single bit flip, one float32 / two bf16 values
    rewritten) changes m_j only, so it changes A. Several changed words cancel only if the mixed values
    collide in both lanes at once: no linear structure survives the mixer (two sign flips no longer cancel,
    as they did in a weighted sum), so that is as unlikely as for random values. The value does not depend
    on the device or the chunking. For the integrity of cached entries (stray writes, bit flips), not for
    identity or against an adversary (the chain hashes and the transfer fingerprints are BLAKE2b)."""
    return checksums([data], chunk_words)[0]
