"""Zero-copy views of the paged pool's bytes in the layouts the decode kernels take.

The pool's KDA page is head-major, `[head][layer slot][recurrent D*D | conv 3*D*(W-1)]` (k3core.cache.layout),
so that one head is one contiguous byte range for the KV transfer service. One KDA layer of every page is
then a `[pages, H, D, D]` state with strides (page, head range, D, 1) and a `[pages, 3, H, D, W-1]` conv
window with strides (page, D*(W-1), head range, W-1, 1): the KDA decode kernels take any strides, so the
fast path runs one launch per layer over all heads on these views, with the request's state page ids as
the slots: no copy, and the per-head transfer layout stays as it is.

MLA pages are `[token][layer slot][latent]`: one layer slot is a `[pages, tokens_per_block, R+P]` view with a
page stride and a row stride, exactly what the paged MLA kernel takes; new rows are written through a
`[rows, R+P]` view of the whole pool, row = (page * tokens_per_block + token) * layers_per_group + slot.
"""

from __future__ import annotations

import torch

from k3core.cache.layout import PoolLayout


def _elements(nbytes: int, dtype: torch.dtype) -> int:
    """A byte count in elements of `dtype` (layout segments are 16-byte aligned, so it divides)."""
    if nbytes % dtype.itemsize:
        raise ValueError(f"{nbytes} bytes (page size, offset or stride) not aligned to {dtype}")
    return nbytes // dtype.itemsize


def _typed(data: torch.Tensor, dtype: torch.dtype, offset_bytes: int) -> tuple[torch.Tensor, int, int]:
    """(the pool as a flat tensor of `dtype`, elements per page, element offset of `offset_bytes`)."""
    per_page, offset = _elements(data.shape[1], dtype), _elements(offset_bytes, dtype)
    return data.view(dtype).view(-1), per_page, offset


class PoolViews:
    """Typed views over one PageStore's `data` ([num_pages, page_bytes] uint8)."""

    def __init__(self, data: torch.Tensor, layout: PoolLayout) -> None:
        self.data = data
        self.layout = layout
        self.num_pages = data.shape[0]

    def kda_state(self, kda_layer: int) -> torch.Tensor:
        """[num_pages, H, D, D] float32 (head stride: one head range): the recurrent states of one layer."""
        lay = self.layout
        d = lay.shape.kda_head_dim
        _, slot = lay.kda_slot(kda_layer)
        flat, per_page, offset = _typed(self.data, lay.state_dtype, slot * lay.kda_layer_stride)
        heads = _elements(lay.kda_head_stride, lay.state_dtype)
        return flat.as_strided((self.num_pages, lay.heads_per_rank, d, d), (per_page, heads, d, 1), offset)

    def kda_conv(self, kda_layer: int) -> torch.Tensor:
        """[num_pages, 3, H, D, W-1]: the q/k/v conv windows of one layer, every head, every page."""
        lay = self.layout
        d, w = lay.shape.kda_head_dim, lay.shape.conv_kernel
        _, slot = lay.kda_slot(kda_layer)
        flat, per_page, offset = _typed(self.data, lay.conv_dtype, slot * lay.kda_layer_stride
                                        + lay.kda_recurrent_bytes)
        heads = _elements(lay.kda_head_stride, lay.conv_dtype)
        return flat.as_strided((self.num_pages, 3, lay.heads_per_rank, d, w - 1),
                               (per_page, d * (w - 1), heads, w - 1, 1), offset)

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
