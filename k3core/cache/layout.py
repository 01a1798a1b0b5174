"""Page sizing for the unified KDA/MLA pool (K3 report §5.4.1).

Every page in the pool has the same byte size, whichever cache group it serves, so one free list, one
refcount array and one eviction path cover both caches. Layers are split into cache groups of
`layers_per_group` layers of one kind (as vLLM's hybrid allocator does):

- a KDA page holds the fixed-size state of one sequence for every layer of one KDA group;
- an MLA page holds `tokens_per_block` tokens of latent KV for every layer of one MLA group.

`tokens_per_block` (the physical block) is the smallest multiple of the hash block whose MLA page is at
least as large as a KDA page; the page size is that MLA page, and KDA pages carry the difference as padding.

Byte layout inside a page, chosen so that each head's bytes are one contiguous range (the unit that the KV
transfer service moves and re-lays out between TP degrees):
- KDA page: [head][layer slot][recurrent D*D (state dtype) | conv 3*D*(W-1) (conv dtype)], each segment
  rounded up to 16 bytes; heads are the heads of this TP rank.
- MLA page: [token][layer slot][latent_dim] in the MLA dtype. The latent is shared by all heads and
  replicated on every TP rank, so an MLA page is a single "head" range; token-major keeps any token prefix
  of a page contiguous (copy-on-write of a partial block, write-back and prefetch move just that prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3core.config import K3Config

SEGMENT_ALIGN = 16


def _align(nbytes: int, to: int = SEGMENT_ALIGN) -> int:
    return (nbytes + to - 1) // to * to


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheShape:
    """What the cache needs to know about a model (whole model, before tensor parallelism)."""

    name: str
    num_kda_layers: int
    num_mla_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    mla_latent_dim: int


@dataclass(frozen=True)
class PoolLayout:
    shape: CacheShape
    tp: int
    state_dtype: torch.dtype
    conv_dtype: torch.dtype
    mla_dtype: torch.dtype
    hash_block_tokens: int
    layers_per_group: int
    tokens_per_block: int
    page_bytes: int
    kda_recurrent_bytes: int  # one head, one layer
    kda_conv_bytes: int  # one head, one layer (the three q/k/v conv tails)
    mla_token_bytes: int  # one token, one layer

    @property
    def heads_per_rank(self) -> int:
        return self.shape.kda_heads // self.tp

    @property
    def kda_layer_stride(self) -> int:
        return self.kda_recurrent_bytes + self.kda_conv_bytes

    @property
    def kda_head_stride(self) -> int:
        return self.layers_per_group * self.kda_layer_stride

    @property
    def kda_page_used_bytes(self) -> int:
        return self.heads_per_rank * self.kda_head_stride

    @property
    def kda_padding_bytes(self) -> int:
        return self.page_bytes - self.kda_page_used_bytes

    @property
    def mla_page_used_bytes(self) -> int:
        return self.layers_per_group * self.tokens_per_block * self.mla_token_bytes

    @property
    def hash_blocks_per_block(self) -> int:
        return self.tokens_per_block // self.hash_block_tokens

    @property
    def num_kda_groups(self) -> int:
        return math.ceil(self.shape.num_kda_layers / self.layers_per_group)

    @property
    def num_mla_groups(self) -> int:
        return math.ceil(self.shape.num_mla_layers / self.layers_per_group)

    def kda_slot(self, kda_layer: int) -> tuple[int, int]:
        """(group, slot in group) of a KDA layer: consecutive layers share a group."""
        return divmod(kda_layer, self.layers_per_group)

    def mla_slot(self, mla_layer: int) -> tuple[int, int]:
        return divmod(mla_layer, self.layers_per_group)

    def mla_prefix_bytes(self, tokens: int) -> int:
        """Bytes of an MLA page holding its first `tokens` tokens (token-major, so a prefix is contiguous)."""
        return tokens * self.layers_per_group * self.mla_token_bytes

    def checkpoint_bytes(self) -> int:
        """GPU bytes of one KDA checkpoint (one page per KDA group)."""
        return self.num_kda_groups * self.page_bytes


def _group_waste(num_kda: int, num_mla: int, per_group: int) -> int:
    return (-num_kda) % per_group + (-num_mla) % per_group


def choose_layers_per_group(num_kda: int, num_mla: int, max_waste: float = 0.05) -> int:
    """Largest group size whose padding slots stay within `max_waste` of all layer slots.

    Fewer, larger groups mean fewer pages per checkpoint and per physical block (less scheduler work);
    the bound keeps the empty layer slots of a last, short group from costing memory. Group sizes above
    the smaller layer count would leave that kind in one mostly padded group, so they are not considered.
    K3 (69 KDA, 24 MLA) gets 24: KDA groups of 24, 24, 21 layers and one MLA group (3 of 96 slots empty).
    """
    kinds = [n for n in (num_kda, num_mla) if n]
    candidates = range(min(kinds), 0, -1)
    for group in candidates:
        slots = sum(math.ceil(n / group) * group for n in kinds)
        if _group_waste(num_kda, num_mla, group) <= max_waste * slots:
            return group
    return 1


def plan_layout(
    shape: CacheShape,
    tp: int = 1,
    *,
    state_dtype: torch.dtype = torch.float32,
    conv_dtype: torch.dtype = torch.bfloat16,
    mla_dtype: torch.dtype = torch.bfloat16,
    hash_block_tokens: int = 512,
    layers_per_group: int | None = None,
    min_tokens_per_block: int = 0,
) -> PoolLayout:
    """Pick the page size and the physical block for `shape` at tensor-parallel degree `tp`.

    The KDA page (all heads of this rank, all layers of a group) fixes the lower bound of the page size;
    the physical block is the smallest multiple of the hash block whose MLA page reaches that bound (and
    `min_tokens_per_block`, used to emulate coarser block grids). The page size is the MLA page.
    """
    if shape.kda_heads % tp:
        raise ValueError(f"tp={tp} does not divide kda_heads={shape.kda_heads}")
    if hash_block_tokens <= 0:
        raise ValueError("hash_block_tokens must be positive")
    group = layers_per_group or choose_layers_per_group(shape.num_kda_layers, shape.num_mla_layers)
    d, w = shape.kda_head_dim, shape.conv_kernel
    recurrent = _align(d * d * dtype_bytes(state_dtype))
    conv = _align(3 * d * (w - 1) * dtype_bytes(conv_dtype))
    token = shape.mla_latent_dim * dtype_bytes(mla_dtype)
    kda_page = (shape.kda_heads // tp) * group * (recurrent + conv)
    mla_per_token = group * token
    tokens = max(math.ceil(kda_page / mla_per_token), min_tokens_per_block, 1)
    tokens = math.ceil(tokens / hash_block_tokens) * hash_block_tokens
    return PoolLayout(
        shape=shape, tp=tp, state_dtype=state_dtype, conv_dtype=conv_dtype, mla_dtype=mla_dtype,
        hash_block_tokens=hash_block_tokens, layers_per_group=group, tokens_per_block=tokens,
        page_bytes=tokens * mla_per_token, kda_recurrent_bytes=recurrent, kda_conv_bytes=conv,
        mla_token_bytes=token,
    )


def shape_from_config(config: K3Config, name: str = "") -> CacheShape:
    return CacheShape(
        name=name, num_kda_layers=len(config.kda_layers), num_mla_layers=len(config.mla_layers),
        kda_heads=config.kda_num_heads, kda_head_dim=config.kda_head_dim,
        conv_kernel=config.short_conv_kernel_size, mla_latent_dim=config.mla_latent_dim,
    )
