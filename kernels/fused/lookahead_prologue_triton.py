"""A decode look-ahead step's prologue (`naive.lookahead_prologue`, which `DecodeInputs.resolve_on_device`
calls through `kernels.dispatch`) as one Triton launch.

In torch it is ~9 elementwise kernels at the head of every look-ahead forward (gather, compare, mask: a few
us each inside the graph, against the ~100 us of host path the look-ahead takes off the device's idle time);
here one program per 128 rows reads each row's source and stop ids and writes its token and, for a row that
stopped, the scratch KDA slot and MLA write row, in place: the device image is written by a fresh copy at
every launch (`DecodeGraphs`), so the values a step leaves there are never read again. On the CPU (its
image may share the host buffer) the reference runs, which writes nothing.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

ROWS = 128  # rows per program


def lookahead_prologue(tokens: torch.Tensor, kda_slots: torch.Tensor, row_base: torch.Tensor, source: torch.Tensor,
                       stops: torch.Tensor, drawn: torch.Tensor, scratch_kda: int,
                       scratch_base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's (tokens, kda_slots, row_base), written into the given tensors (returned) in one launch
    (any device Triton runs on); each part contiguous, as `DecodeInputs.view` cuts them."""
    rows = tokens.shape[0]
    _resolve[(triton.cdiv(rows, ROWS),)](tokens, kda_slots, row_base, source, stops, drawn, rows, scratch_kda,
                                         scratch_base, KDA=kda_slots.shape[0], MLA=row_base.shape[0],
                                         WIDTH=stops.shape[0], ROWS=ROWS, num_warps=1)
    return tokens, kda_slots, row_base


if triton is not None:
    @triton.jit
    def _resolve(tokens_ptr, slots_ptr, base_ptr, source_ptr, stops_ptr, drawn_ptr, rows, scratch_kda, scratch_base,
                 KDA: tl.constexpr, MLA: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr):
        at = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        inside = at < rows
        source = tl.load(source_ptr + at, mask=inside, other=-1)
        ahead = inside & (source >= 0)
        token = tl.where(ahead, tl.load(drawn_ptr + tl.maximum(source, 0), mask=ahead, other=0),
                         tl.load(tokens_ptr + at, mask=inside, other=0))
        tl.store(tokens_ptr + at, token, mask=inside)
        stopped = at < 0  # all false
        for w in tl.static_range(WIDTH):
            stopped = stopped | (tl.load(stops_ptr + w * rows + at, mask=inside, other=-1) == token)
        stopped = stopped & ahead
        for g in tl.static_range(KDA):
            tl.store(slots_ptr + g * rows + at, tl.zeros([ROWS], dtype=tl.int64) + scratch_kda, mask=stopped)
        for m in tl.static_range(MLA):
            tl.store(base_ptr + m * rows + at, tl.zeros([ROWS], dtype=tl.int64) + scratch_base, mask=stopped)
