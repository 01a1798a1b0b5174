"""The per-step inputs of a decode forward as one int64 buffer: built on the host, copied in one transfer.

Rows past the real batch (padding up to the CUDA-graph bucket) point at two scratch pages the fast path
owns (a KDA page for the states, an MLA page for the latent row and its one-row attention), so the padded
rows compute harmless garbage and never touch a request's pages.

Two parts serve the decode look-ahead (decode_lookahead.py), where a step is launched before the previous
step's tokens reach the host: `source` (a row's token is the previous draw's row `source`, -1: the image's
token) and `stops` (a row's stop token ids and EOS, -1 padded): a row whose drawn token is one of them
(its request stopped) runs as a padding row (`resolve_on_device`), so its state stays the one its last
token left. A builder without the look-ahead leaves them empty: its images are the five parts alone (the
look-ahead's add 1 + STOP_WIDTH int64 a row, 5 to K3's 12 at 32K tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from k3core.cache.layout import PoolLayout
from k3core.cache.request import CachedRequest
from kernels import dispatch

STOP_WIDTH = 4  # stop ids (EOS included) a row may have in a look-ahead step


@dataclass
class DecodeInputs:
    """Views into one flat int64 tensor (device side), for a batch of `size` rows."""

    flat: torch.Tensor
    tokens: torch.Tensor  # [B]
    kda_slots: torch.Tensor  # [kda groups, B]: the state page of each row
    page_table: torch.Tensor  # [mla groups, B, max_pages]
    lengths: torch.Tensor  # [B]: tokens after this step (context + 1)
    row_base: torch.Tensor  # [mla groups, B]: row of layer slot 0 of the new token in PoolViews.mla_rows()
    source: torch.Tensor  # [B]: the previous draw's row holding this row's token, -1: `tokens` holds it
    stops: torch.Tensor  # [STOP_WIDTH, B]: token ids that end the row's request (-1: none)
    # (`source` and `stops` are empty, [0] and [0, B], in an image without the look-ahead: `ahead` False)

    @staticmethod
    def shapes(size: int, kda_groups: int, mla_groups: int, max_pages: int, ahead: bool) -> list[tuple[int, ...]]:
        """The parts' shapes, in their order in the flat buffer (tokens, kda_slots, page_table, lengths,
        row_base, source, stops; the last two empty unless `ahead`)."""
        return [(size,), (kda_groups, size), (mla_groups, size, max_pages), (size,), (mla_groups, size),
                (size if ahead else 0,), (STOP_WIDTH if ahead else 0, size)]

    @classmethod
    def view(cls, flat: torch.Tensor, size: int, kda_groups: int, mla_groups: int, max_pages: int,
             ahead: bool) -> DecodeInputs:
        shapes = cls.shapes(size, kda_groups, mla_groups, max_pages, ahead)
        sizes = [math.prod(shape) for shape in shapes]
        parts = flat[: sum(sizes)].split(sizes)
        return cls(flat, *(part.view(shape) for part, shape in zip(parts, shapes, strict=True)))

    @staticmethod
    def numel(size: int, kda_groups: int, mla_groups: int, max_pages: int, ahead: bool) -> int:
        return size * (2 + (1 + STOP_WIDTH) * ahead + kda_groups + mla_groups * (max_pages + 1))

    def resolve_on_device(self, drawn: torch.Tensor, scratch_kda: int, scratch_base: int) -> DecodeInputs:
        """The inputs with each `source` row's token read from `drawn` (the previous step's draw, on the
        device) and the rows whose token is one of their `stops` pointed at the scratch pages, as padding
        rows are: their request stopped on that token, so this step must leave its state alone
        (`kernels.dispatch.lookahead_prologue`: on CUDA one Triton launch writing this image in place, as a
        fresh copy fills it at every launch; elsewhere new tensors, since a CPU image may share the host
        buffer)."""
        tokens, kda_slots, row_base = dispatch.lookahead_prologue(self.tokens, self.kda_slots, self.row_base,
                                                                  self.source, self.stops, drawn, scratch_kda,
                                                                  scratch_base)
        return replace(self, tokens=tokens, kda_slots=kda_slots, row_base=row_base)


class DecodeInputBuilder:
    """Fills the host image of DecodeInputs for the requests of a step.

    Each request's KDA slots and page-table row live in a row of an arena (kept across steps), so a step
    gathers them with one fancy index instead of stacking a table per request; a row is refreshed only
    when its block table grew. A row is valid for as long as the request's `blocks` and `state_pages` lists
    are the ones it was filled from: the cache manager gives a request new lists when it is admitted again,
    and while it lives its block table only grows (admission fills it, `reserve` appends).
    """

    def __init__(self, layout: PoolLayout, max_pages: int, scratch_kda: int, scratch_mla: int,
                 lookahead: bool = False) -> None:
        self.layout = layout
        self.lookahead = lookahead  # images with the look-ahead's `source` and `stops` parts
        self.max_pages = max_pages
        self.scratch_kda, self.scratch_mla = scratch_kda, scratch_mla
        self.kda_groups, self.mla_groups = layout.num_kda_groups, layout.num_mla_groups
        self._scratch_base = scratch_mla * layout.tokens_per_block * layout.layers_per_group
        self._rows: dict[str, tuple[list, list, int]] = {}  # rid -> (blocks, state_pages, arena row)
        self._free: list[int] = []
        # Arenas with the row axis second, the image's own layout: a step's rows are gathered straight into the
        # image (`np.take(..., out=)`: half the time of a gather and a transposed copy at 256 rows).
        self._slots = np.empty((self.kda_groups, 0), dtype=np.int64)  # [kda group, row]
        self._tables = np.empty((self.mla_groups, 0, max_pages), dtype=np.int64)  # [mla group, row, page]
        self._filled = np.empty(0, dtype=np.int64)  # [row]: blocks of its table written so far

    def fits(self, req: CachedRequest) -> bool:
        return len(req.blocks) <= self.max_pages

    def _row(self, req: CachedRequest, replaced: list[int]) -> int:
        """The arena row of a request (a new one the first time its lists are seen)."""
        entry = self._rows.get(req.rid)
        if entry is not None and entry[0] is req.blocks and entry[1] is req.state_pages:
            return entry[2]
        if entry is not None:
            replaced.append(entry[2])  # freed after this step's gather (a row of this step may still read it)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._slots[:, row] = req.state_pages
        self._tables[:, row] = self.scratch_mla
        self._filled[row] = 0
        self._rows[req.rid] = (req.blocks, req.state_pages, row)
        return row

    def _grow(self) -> None:
        old = len(self._filled)
        new = max(64, 2 * old)
        self._slots = np.concatenate([self._slots, np.empty((self.kda_groups, new - old), dtype=np.int64)], axis=1)
        self._tables = np.concatenate([self._tables, np.empty((self.mla_groups, new - old, self.max_pages),
                                                              dtype=np.int64)], axis=1)
        self._filled = np.concatenate([self._filled, np.zeros(new - old, dtype=np.int64)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _extend_table(self, req: CachedRequest, row: int) -> None:
        """Write the blocks appended to a request's table since its row was last filled."""
        first = int(self._filled[row])
        blocks = req.blocks
        self._tables[:, row, first : len(blocks)] = np.array([b.pages for b in blocks[first:]], dtype=np.int64).T
        self._filled[row] = len(blocks)

    def _prune(self, requests: list[CachedRequest]) -> None:
        """Free the rows of finished requests once they outnumber the live ones."""
        if len(self._rows) > 2 * len(requests) + 64:
            live = {r.rid for r in requests}
            for rid in [r for r in self._rows if r not in live]:
                self._free.append(self._rows.pop(rid)[2])

    def numel(self, size: int) -> int:
        return DecodeInputs.numel(size, self.kda_groups, self.mla_groups, self.max_pages, self.lookahead)

    def view(self, flat: torch.Tensor, size: int) -> DecodeInputs:
        return DecodeInputs.view(flat, size, self.kda_groups, self.mla_groups, self.max_pages, self.lookahead)

    def _host_parts(self, out: np.ndarray, size: int) -> tuple[np.ndarray, ...]:
        """The parts of `DecodeInputs.view` as numpy views (numpy slicing costs a tenth of torch's here)."""
        parts, start = [], 0
        for shape in DecodeInputs.shapes(size, self.kda_groups, self.mla_groups, self.max_pages, self.lookahead):
            end = start + math.prod(shape)
            parts.append(out[start:end].reshape(shape))
            start = end
        return tuple(parts)

    def build(self, requests: list[CachedRequest], tokens: list[int], size: int,
              out: np.ndarray | None = None) -> np.ndarray:
        """Host int64 image for `size` rows (len(requests) real rows, the rest padding), into `out` if given."""
        out = self.prepare(requests, size, out)
        self.token_slots(out, len(requests))[:] = tokens
        return out

    def prepare(self, requests: list[CachedRequest], size: int, out: np.ndarray | None = None) -> np.ndarray:
        """`build` without the tokens (left 0): every row's pages and position (num_computed) are known
        before the token is. A row whose position starts a block it does not hold yet gets that block
        through `refresh` once it is reserved."""
        n, per_block = len(requests), self.layout.tokens_per_block
        out = np.empty(self.numel(size), dtype=np.int64) if out is None else out[: self.numel(size)]
        tok, slots, table, lengths, base, source, stops = self._host_parts(out, size)
        tok[:] = 0
        source[:] = -1
        stops[:] = -1
        self._pad(slots, table, lengths, base, slice(n, None))
        if not n:
            return out
        self._prune(requests)
        replaced: list[int] = []
        known = self._rows.get  # inlined `_row` for a request whose row is current (nearly every one, every step)
        rows = np.fromiter((e[2] if (e := known(r.rid)) is not None and e[0] is r.blocks and e[1] is r.state_pages
                            else self._row(r, replaced) for r in requests), dtype=np.int64, count=n)
        blocks = np.fromiter((len(r.blocks) for r in requests), dtype=np.int64, count=n)
        for i in np.flatnonzero(blocks != self._filled[rows]).tolist():
            self._extend_table(requests[i], int(rows[i]))
        # rows are in range; "clip" writes `out` directly where it is contiguous (a batch that fills its bucket:
        # "raise" always goes through a copy), a padded batch's columns go through numpy's copy either way
        np.take(self._slots, rows, axis=1, out=slots[:, :n], mode="clip")
        np.take(self._tables, rows, axis=1, out=table[:, :n], mode="clip")
        position = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=n)
        lengths[:n] = position + 1
        pages = table[:, np.arange(n), np.minimum(position // per_block, self.max_pages - 1)]  # [mla groups, n]
        base[:, :n] = (pages * per_block + position % per_block) * self.layout.layers_per_group
        self._free.extend(replaced)
        return out

    def _pad(self, slots: np.ndarray, table: np.ndarray, lengths: np.ndarray, base: np.ndarray, rows) -> None:
        slots[:, rows] = self.scratch_kda
        table[:, rows] = self.scratch_mla
        lengths[rows] = 1
        base[:, rows] = self._scratch_base

    def compact(self, src: np.ndarray, src_size: int, rows: list[int], out: np.ndarray, size: int) -> np.ndarray:
        """Rows `rows` of a prepared image, in order, as the first rows of an image of `size` rows in `out`
        (which may be `src` itself), the rest padding: the batch a fresh `prepare` of those requests gives."""
        out = out[: self.numel(size)]
        # (an empty part, `source` without the look-ahead, picks nothing)
        picked = [part[:, rows] if part.ndim > 1 else part[rows] if len(part) else part
                  for part in self._host_parts(src, src_size)]
        tok, slots, table, lengths, base, source, stops = parts = self._host_parts(out, size)
        for part, values in zip(parts, picked, strict=True):
            if part.ndim == 1:
                part[: len(rows)] = values
            else:
                part[:, : len(rows)] = values
        tok[len(rows):] = 0
        source[len(rows):] = -1
        stops[:, len(rows):] = -1
        self._pad(slots, table, lengths, base, slice(len(rows), None))
        return out

    def refresh(self, out: np.ndarray, size: int, requests: list[CachedRequest], rows: list[int]) -> None:
        """Rewrite rows of a prepared image from their requests (a block reserved since `prepare`)."""
        _, _, table, _, base, _, _ = self._host_parts(out, size)
        per_block = self.layout.tokens_per_block
        replaced: list[int] = []
        for req, i in zip(requests, rows, strict=True):
            row = self._row(req, replaced)  # the row `prepare` gave it
            self._extend_table(req, row)
            table[:, i] = self._tables[:, row]
            position = req.num_computed
            base[:, i] = (table[:, i, position // per_block] * per_block + position % per_block) \
                * self.layout.layers_per_group
        self._free.extend(replaced)

    def ahead_parts(self, out: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """An image's `source` [size] and `stops` [STOP_WIDTH, size] parts, as views."""
        return self._host_parts(out, size)[5:]

    @property
    def scratch_base(self) -> int:
        """`row_base` of a padding row."""
        return self._scratch_base

    @staticmethod
    def token_slots(out: np.ndarray, rows: int) -> np.ndarray:
        """The tokens of an image's first `rows` rows, as a view (the tokens lead the image at any size)."""
        return out[:rows]
