"""The look-ahead prologue's Triton launch (kernels/fused/lookahead_prologue_triton.py) against its reference
(kernels/fused/naive.py, which `DecodeInputs.resolve_on_device` runs off CUDA, itself checked by hand in
tests/workers/test_decode_lookahead.py), through Triton's
interpreter on the CPU (compiled on a GPU, where the tensors live there): random images over bucket sizes
that end inside a program's rows and span several programs, rows from the draw and from the image,
stopped rows, padding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.fused import lookahead_prologue_triton as lp
from kernels.fused import naive
from services.engine.decode_inputs import STOP_WIDTH, DecodeInputs

pytestmark = pytest.mark.skipif(lp.triton is None, reason="no triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 5, lp.ROWS + 3])
@pytest.mark.parametrize("groups", [(1, 1), (3, 5)])
def test_the_launch_writes_what_the_reference_computes(rows, groups):
    kda, mla = groups
    g = torch.Generator().manual_seed(rows * 10 + kda)
    flat = torch.randint(0, 50, (DecodeInputs.numel(rows, kda, mla, 2, True),), generator=g)
    inp = DecodeInputs.view(flat.to(DEVICE), rows, kda, mla, 2, True)
    drawn = torch.randint(0, 50, (rows + 4,), generator=g).to(DEVICE)
    inp.source.copy_(torch.randint(-1, rows + 4, (rows,), generator=g))
    stops = torch.full((STOP_WIDTH, rows), -1)
    stops[0] = torch.randint(0, 50, (rows,), generator=g)
    picked = torch.randint(0, 2, (rows,), generator=g).bool() & (inp.source.cpu() >= 0)
    stops[1, picked] = drawn.cpu()[inp.source.cpu().clamp(min=0)][picked]  # these rows stop
    inp.stops.copy_(stops)
    parts = (inp.tokens, inp.kda_slots, inp.row_base, inp.source, inp.stops, drawn)
    want = replace(inp, **dict(zip(("tokens", "kda_slots", "row_base"), naive.lookahead_prologue(*parts, 991, 992),
                                   strict=True)))
    written = lp.lookahead_prologue(*parts, 991, 992)
    assert all(out is part for out, part in zip(written, parts[:3], strict=True))  # in place
    assert torch.equal(inp.tokens, want.tokens)
    assert torch.equal(inp.kda_slots, want.kda_slots) and torch.equal(inp.row_base, want.row_base)
    assert (want.kda_slots[0] == 991)[picked].all()  # the rows meant to stop did (and a row from the image never)
    assert not (want.kda_slots[0] == 991)[inp.source.cpu() < 0].any()
