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
    raw = data.detach().contiguous().view(torch.uint8).reshape(1, -1)
    return checksum_rows(raw, [0], raw.shape[1], chunk_words)[0]


def checksum_rows(matrix: torch.Tensor, rows: Sequence[int], num_bytes: int, chunk_words: int | None = None
                  ) -> torch.Tensor:
    """The lanes of `checksum(matrix[r, :num_bytes])` for each r in `rows`, as int64 [len(rows), 2] on the
    matrix's device (no host sync). All rows go through each column chunk together: one gather and one set
    of elementwise launches per chunk for every row (a chunk holds about `chunk_words` words in all), and
    the XOR lane is folded once at the end, so the launches grow with the bytes checksummed, not with the
    number of rows (pages smaller than a chunk share its launches)."""
    raw = matrix.detach().view(torch.uint8)
    device = raw.device
    if not rows:
        return torch.empty(0, 2, dtype=torch.int64, device=device)
    index = torch.tensor(list(rows), dtype=torch.int64).to(device, non_blocking=True)
    budget = chunk_words or (_CPU_CHUNK_WORDS if device.type == "cpu" else _DEVICE_CHUNK_WORDS)
    step = 4 * max(1, budget // len(rows))
    total = torch.zeros(len(rows), dtype=torch.int64, device=device)
    folded: torch.Tensor | None = None  # [rows, chunk words]: XOR of every chunk, column by column
    for start in range(0, num_bytes, step):
        part = raw[:, start : min(start + step, num_bytes)].index_select(0, index)  # contiguous, aligned
        if part.shape[1] % 4:
            part = torch.nn.functional.pad(part, (0, -part.shape[1] % 4))  # the last word, zero-padded
        words = part.view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)  # little-endian uint32
        keys = position_keys(start // 4, words.shape[1], device)
        mixed = mix63_(words.add_(keys).bitwise_and_(MASK63))
        total += mixed.sum(dim=1)  # int64 sums wrap mod 2**64 on every device; masked below
        if folded is None:
            folded = mixed
        else:
            folded[:, : mixed.shape[1]] ^= mixed
    xor = total if folded is None else xor_fold(folded)  # no bytes: both lanes 0 (and the length 0)
    return torch.stack([total & MASK63, xor ^ num_bytes], dim=1)


def xor_fold(x: torch.Tensor) -> torch.Tensor:
    """XOR along the last dim of an int64 tensor [R, n >= 1] -> [R] (torch has no xor reduction): halve and
    fold."""
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        head = x[:, :half] ^ x[:, half : 2 * half]
        if x.shape[1] % 2:
            head[:, :1] ^= x[:, -1:]
        x = head
    return x[:, 0]


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
