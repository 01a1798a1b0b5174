"""The bytes behind the pool: one uint8 tensor [num_pages, page_bytes], typed views into it, and copies.

The scheduler-side logic (pool, index, checkpoints, manager) works on page ids only and runs without a
store (the benchmark does); a worker attaches a store to hold real tensors. KDA and MLA pages have
different layouts (see `layout`), so reading a page as the wrong kind yields meaningless numbers; with
`debug=True` every typed access checks the pool's page-kind tag and raises `PageKindError` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.cache.hashing import checksum, checksum_rows, fingerprint, lanes_to_int
from k3core.cache.layout import PoolLayout
from k3core.cache.pool import PageKind, PagePool
from k3core.host_copy import HostCopy


class PageKindError(RuntimeError):
    """A page was accessed as a kind it does not hold (debug mode)."""


class IntegrityError(RuntimeError):
    """Bytes do not match their fingerprint."""


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy `num_bytes` from the start of a source to the start of page `dst`.

    The source is a pool page (`src_page`) or host bytes (`src_host`, from the CPU tier)."""

    dst: int
    num_bytes: int
    src_page: int = -1
    src_host: torch.Tensor | None = None


class PendingFingerprints:
    """Checksum lanes computed (or queued) on the pool's device, on their way to pinned host memory."""

    def __init__(self, lanes: torch.Tensor) -> None:
        self._copy = HostCopy(lanes)

    def result(self) -> list[int]:
        """The fingerprints (waits for the device only if the checksum has not finished yet)."""
        return [lanes_to_int(pair) for pair in self._copy.wait().tolist()]


class PageStore:
    def __init__(self, layout: PoolLayout, pool: PagePool, device: str | torch.device = "cpu",
                 debug: bool = False) -> None:
        self.layout = layout
        self.pool = pool
        self.debug = debug
        self.data = torch.zeros(pool.num_pages, layout.page_bytes, dtype=torch.uint8, device=device)

    # ---- typed views ----------------------------------------------------------------------------------
    def _check(self, page: int, kind: PageKind) -> None:
        if self.debug and self.pool.kind[page] != kind:
            raise PageKindError(f"page {page} holds {self.pool.kind[page].name}, accessed as {kind.name}")

    def kda_views(self, page: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [3,H,D,W-1], recurrent [H,D,D]) views of one layer slot of a KDA state page."""
        self._check(page, PageKind.KDA)
        lay = self.layout
        heads, d, w = lay.heads_per_rank, lay.shape.kda_head_dim, lay.shape.conv_kernel
        per_head = self.data[page, : lay.kda_page_used_bytes].view(heads, lay.kda_head_stride)
        base = slot * lay.kda_layer_stride
        recurrent_bytes = d * d * lay.state_dtype.itemsize
        conv_bytes = 3 * d * (w - 1) * lay.conv_dtype.itemsize
        recurrent = per_head[:, base : base + recurrent_bytes].view(lay.state_dtype).view(heads, d, d)
        conv_start = base + lay.kda_recurrent_bytes
        conv = per_head[:, conv_start : conv_start + conv_bytes].view(lay.conv_dtype)
        return conv.view(heads, 3, d, w - 1).transpose(0, 1), recurrent

    def mla_rows(self, page: int, slot: int) -> torch.Tensor:
        """[tokens_per_block, latent_dim] (strided) view of one layer slot of an MLA page."""
        self._check(page, PageKind.MLA)
        lay = self.layout
        raw = self.data[page, : lay.mla_page_used_bytes].view(lay.mla_dtype)
        return raw.view(lay.tokens_per_block, lay.layers_per_group, lay.shape.mla_latent_dim)[:, slot]

    def head_range(self, head: int) -> tuple[int, int]:
        """Byte range of one KDA head inside a KDA page (the per-head transfer unit)."""
        stride = self.layout.kda_head_stride
        return head * stride, (head + 1) * stride

    # ---- whole-page bytes -----------------------------------------------------------------------------
    def read(self, page: int, num_bytes: int) -> torch.Tensor:
        return self.data[page, :num_bytes].to("cpu", copy=True)

    def fingerprint(self, page: int, num_bytes: int) -> int:
        """The integrity checksum of a page's first bytes, computed on the pool's device (`hashing.checksum`)."""
        return checksum(self.data[page, :num_bytes])

    def fingerprints(self, pages: list[int], num_bytes: int) -> list[int]:
        """`fingerprint` of each page, row-batched (`checksum_rows`: one set of launches per chunk for all
        pages, not per page), with one device sync for all of them."""
        return [lanes_to_int(pair) for pair in checksum_rows(self.data, pages, num_bytes).tolist()]

    def fingerprints_later(self, pages: list[int], num_bytes: int) -> PendingFingerprints:
        """`fingerprints` without waiting: the checksum is queued on the pool's device now (so it reads the
        bytes as they are at this point of the stream) and its lanes copied to the host behind it."""
        return PendingFingerprints(checksum_rows(self.data, pages, num_bytes))

    def zero(self, page: int) -> None:
        self.data[page].zero_()

    def run(self, ops: list[CopyOp]) -> None:
        for op in ops:
            if op.src_host is not None:
                self.data[op.dst, : op.num_bytes].copy_(op.src_host[: op.num_bytes])
            else:
                self.data[op.dst, : op.num_bytes].copy_(self.data[op.src_page, : op.num_bytes])

    def export_page(self, page: int, num_bytes: int) -> tuple[torch.Tensor, int]:
        """Bytes and fingerprint of a page for the transfer service."""
        data = self.read(page, num_bytes)
        return data, fingerprint(data)

    def import_page(self, page: int, data: torch.Tensor, expected: int) -> None:
        if fingerprint(data) != expected:
            raise IntegrityError(f"page {page}: transferred bytes do not match their fingerprint")
        self.data[page, : data.numel()].copy_(data)
