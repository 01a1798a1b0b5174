"""A look-ahead step's prologue (`DecodeInputs.resolve_on_device`) as one Triton launch on CUDA.

In torch it is ~9 elementwise kernels at the head of every look-ahead forward (gather, compare, mask: a few
us each inside the graph, against the ~100 us of host path the look-ahead takes off the device's idle time);
here one program per 128 rows reads each row's source and stop ids and writes its token and, for a row that
stopped, the scratch KDA slot and MLA write row, in place: the device image is written by a fresh copy at
every launch (`DecodeGraphs`), so the values a step leaves there are never read again. On the CPU (its
image may share the host buffer) the torch form runs.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from services.engine.decode_inputs import DecodeInputs

ROWS = 128  # rows per program


def resolve(inp: DecodeInputs, drawn: torch.Tensor, scratch_kda: int, scratch_base: int) -> DecodeInputs:
    """`inp.resolve_on_device(...)`: in place through one Triton launch on CUDA, the torch form elsewhere."""
    if inp.tokens.device.type != "cuda" or triton is None:
        return inp.resolve_on_device(drawn, scratch_kda, scratch_base)
    resolve_triton(inp, drawn, scratch_kda, scratch_base)
    return inp


def resolve_triton(inp: DecodeInputs, drawn: torch.Tensor, scratch_kda: int, scratch_base: int) -> None:
    """Write the resolved tokens, KDA slots and MLA write rows into `inp`'s own tensors (any device Triton
    runs on)."""
    rows = inp.tokens.shape[0]
    _resolve[(triton.cdiv(rows, ROWS),)](inp.tokens, inp.kda_slots, inp.row_base, inp.source, inp.stops, drawn,
                                         rows, scratch_kda, scratch_base, KDA=inp.kda_slots.shape[0],
                                         MLA=inp.row_base.shape[0], WIDTH=inp.stops.shape[0], ROWS=ROWS,
                                         num_warps=1)


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
