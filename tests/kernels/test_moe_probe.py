"""bench.moe_probe's stream kernels (interpreted) read exactly the gate/up bytes of the experts asked for:
their folds against a torch fold of the same tensors, from blocked and whole-row storage."""

from __future__ import annotations

import torch

from bench.moe_probe import flat_stream, probes, storages, tile_stream
from k3core.quant.mxfp4 import quantize

E, L, F, ROWS = 4, 256, 64, 32
GATE_UPS = storages(*quantize(torch.randn(E, 2 * F, L, generator=torch.Generator().manual_seed(3))))


def _xor(t: torch.Tensor, dim: int) -> torch.Tensor:
    out = torch.zeros_like(t.select(dim, 0))
    for i in range(t.shape[dim]):
        out ^= t.select(dim, i)
    return out


def _expected_tile_folds(ids: torch.Tensor) -> torch.Tensor:
    """The kernel's fold from the whole-row tensors: per (expert, row block) the XOR over 128-column steps
    of gate ^ up words ([ROWS, 16] per step), summed, plus the same for the multipliers ([ROWS, 4])."""
    words, mults = GATE_UPS["rows"].words.long(), GATE_UPS["rows"].mults.long()
    out = torch.empty(ids.numel(), F // ROWS, dtype=torch.int64)
    for i, e in enumerate(ids.tolist()):
        for j in range(F // ROWS):
            r = slice(j * ROWS, (j + 1) * ROWS)
            w = words[e, r] ^ words[e, F + j * ROWS:F + (j + 1) * ROWS]  # [ROWS, L / 8]
            m = mults[e, r] ^ mults[e, F + j * ROWS:F + (j + 1) * ROWS]  # [ROWS, L / 32]
            total = _xor(w.unflatten(1, (-1, 16)), 1).sum() + _xor(m.unflatten(1, (-1, 4)), 1).sum()
            out[i, j] = (total + 2**31) % 2**32 - 2**31  # int32 wrap-around, as the kernel sums
    return out


def test_tile_stream_reads_the_gate_up_bytes_of_the_asked_experts(interpreted):
    ids = torch.tensor([3, 1], dtype=torch.int32)
    expected = _expected_tile_folds(ids)
    for storage, gate_up in GATE_UPS.items():
        got = tile_stream(ids, gate_up, ROWS, 1, 2)
        assert torch.equal(got.long(), expected), storage


def test_flat_stream_folds_each_range_of_the_asked_experts(interpreted):
    ids = torch.tensor([2, 0], dtype=torch.int32)
    words = GATE_UPS["blocked"].words
    got = flat_stream(ids, words, 64, 4, 1)  # [2, 2F L / 8 / 256]
    flat = words.reshape(E, -1, 4, 64)[ids.long()]  # [2, ranges, steps, block]
    assert torch.equal(got, _xor(flat, 2).sum(-1, dtype=torch.int64).add(2**31).remainder(2**32).sub(2**31).int())


def test_probe_bytes_are_the_gate_up_words_and_multipliers():
    calls = probes(torch.tensor([0, 1, 2], dtype=torch.int32), GATE_UPS)
    per_expert = 2 * F * L // 2 + 2 * F * L // 32
    assert calls["tile_stream blocked 64x128 w2 s3"][1] == 3 * per_expert
    assert calls["flat_stream words 1024x8 w4"][1] == 3 * 2 * F * L // 2
