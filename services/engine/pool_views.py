"""Zero-copy views of the paged pool's bytes in the layouts the decode kernels take.

The pool's KDA page is head-major, `[head][layer slot][recurrent D*D | conv 3*D*(W-1)]` (k3core.cache.layout),
so that one head is one contiguous byte range for the KV transfer service. The fused KDA kernel addresses
its state as `[slots, H, D, D]` with the heads of a slot adjacent (head stride D*D), which that layout
cannot provide for H > 1 without giving up the per-head ranges. One (layer, head) pair, however, *is* a
`[slots, 1, D, D]` state and a `[slots, 3, 1, D, W-1]` conv window with the page as the slot (stride: one
page), so the fast path runs the kernel per head on these views with the request's state page ids as the
slots: no copy, and the per-head transfer layout stays as it is.

MLA pages are `[token][layer slot][latent]`: one layer slot is a `[pages, tokens_per_block, R+P]` view with a
page stride and a row stride, exactly what the paged MLA kernel takes; new rows are written through a
`[rows, R+P]` view of the whole pool, row = (page * tokens_per_block + token) * layers_per_group + slot.
"""

from __future__ import annotations

import torch

from k3core.cache.layout import PoolLayout


def _typed(data: torch.Tensor, dtype: torch.dtype, offset_bytes: int) -> tuple[torch.Tensor, int, int]:
    """(the pool as a flat tensor of `dtype`, elements per page, element offset of `offset_bytes`)."""
    size = dtype.itemsize
    if data.shape[1] % size or offset_bytes % size:
        raise ValueError(f"page bytes {data.shape[1]} / offset {offset_bytes} not aligned to {dtype}")
    return data.view(dtype).view(-1), data.shape[1] // size, offset_bytes // size


class PoolViews:
    """Typed views over one PageStore's `data` ([num_pages, page_bytes] uint8)."""

    def __init__(self, data: torch.Tensor, layout: PoolLayout) -> None:
        self.data = data
        self.layout = layout
        self.num_pages = data.shape[0]

    def kda_state(self, kda_layer: int, head: int) -> torch.Tensor:
        """[num_pages, 1, D, D] float32: the recurrent state of one layer and head of every page."""
        lay = self.layout
        d = lay.shape.kda_head_dim
        _, slot = lay.kda_slot(kda_layer)
        flat, per_page, offset = _typed(self.data, lay.state_dtype, head * lay.kda_head_stride
                                        + slot * lay.kda_layer_stride)
        return flat.as_strided((self.num_pages, 1, d, d), (per_page, d * d, d, 1), offset)

    def kda_conv(self, kda_layer: int, head: int) -> torch.Tensor:
        """[num_pages, 3, 1, D, W-1]: the q/k/v conv windows of one layer and head of every page."""
        lay = self.layout
        d, w = lay.shape.kda_head_dim, lay.shape.conv_kernel
        _, slot = lay.kda_slot(kda_layer)
        flat, per_page, offset = _typed(self.data, lay.conv_dtype, head * lay.kda_head_stride
                                        + slot * lay.kda_layer_stride + lay.kda_recurrent_bytes)
        window = d * (w - 1)
        return flat.as_strided((self.num_pages, 3, 1, d, w - 1), (per_page, window, window, w - 1, 1), offset)

    def mla_cache(self, mla_layer: int) -> torch.Tensor:
        """[num_pages, tokens_per_block, R+P] (page and row strided) latent rows of one MLA layer."""
        lay = self.layout
        width = lay.shape.mla_latent_dim
        _, slot = lay.mla_slot(mla_layer)
        flat, per_page, offset = _typed(self.data, lay.mla_dtype, slot * lay.mla_token_bytes)
        return flat.as_strided((self.num_pages, lay.tokens_per_block, width),
                               (per_page, lay.layers_per_group * width, 1), offset)

    def mla_rows(self) -> torch.Tensor:
        """[num_pages * tokens_per_block * layers_per_group, R+P]: every latent row slot of the pool."""
        lay = self.layout
        flat, per_page, _ = _typed(self.data, lay.mla_dtype, 0)
        width = lay.shape.mla_latent_dim
        rows_per_page = lay.tokens_per_block * lay.layers_per_group
        if per_page != rows_per_page * width:  # plan_layout sizes a page as exactly one MLA block
            raise ValueError(f"an MLA page holds {rows_per_page} rows of {width}, not {per_page} elements")
        return flat.view(-1, width)

    def mla_row_base(self, page: int, token: int) -> int:
        """Row of layer slot 0 of `token` (page-local) of MLA page `page` in `mla_rows()`; add the slot."""
        lay = self.layout
        return (page * lay.tokens_per_block + token) * lay.layers_per_group
