"""The look-ahead prologue's Triton launch (services/engine/lookahead_prologue.py) against the torch form
(`DecodeInputs.resolve_on_device`, itself checked by hand in test_decode_lookahead.py), through Triton's
interpreter on the CPU (compiled on a GPU, where the tensors live there): random images over bucket sizes
that end inside a program's rows and span several programs, rows from the draw and from the image,
stopped rows, padding."""

from __future__ import annotations

import pytest
import torch

from services.engine import lookahead_prologue as lp
from services.engine.decode_inputs import STOP_WIDTH, DecodeInputs

pytestmark = pytest.mark.skipif(lp.triton is None, reason="no triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 5, lp.ROWS + 3])
@pytest.mark.parametrize("groups", [(1, 1), (3, 5)])
def test_the_launch_writes_what_the_torch_form_computes(rows, groups):
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
    want = inp.resolve_on_device(drawn, 991, 992)
    lp.resolve_triton(inp, drawn, 991, 992)
    assert torch.equal(inp.tokens, want.tokens)
    assert torch.equal(inp.kda_slots, want.kda_slots) and torch.equal(inp.row_base, want.row_base)
    assert (want.kda_slots[0] == 991)[picked].all()  # the rows meant to stop did (and a row from the image never)
    assert not (want.kda_slots[0] == 991)[inp.source.cpu() < 0].any()
