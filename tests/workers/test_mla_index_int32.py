"""services/engine/fast_decoder.mla_index_int32: the MLA kernel's page table and lengths as int32 copies of the
step image's int64 parts (one conversion when they are adjacent, as `DecodeInputs.view` lays them out), the
other parts untouched; K3_MLA_INT32=0 hands the inputs back as they are. (The fast path's CPU tests,
tests/workers/test_fast*.py, run the decode forward with the conversion on.)"""

from __future__ import annotations

import torch

from services.engine.decode_inputs import DecodeInputs
from services.engine.fast_decoder import MLA_INT32_ENV, mla_index_int32

SIZES = (3, 2, 2, 4, True)  # rows, KDA groups, MLA groups, pages a row, look-ahead parts


def image() -> DecodeInputs:
    numel = DecodeInputs.numel(*SIZES)
    return DecodeInputs.view(torch.arange(numel, dtype=torch.int64) * 7 - 5, *SIZES)


def test_int32_copies_of_the_two_parts(monkeypatch):
    monkeypatch.delenv(MLA_INT32_ENV, raising=False)
    inp = image()
    out = mla_index_int32(inp)
    assert out.page_table.dtype == out.lengths.dtype == torch.int32
    assert out.page_table.shape == inp.page_table.shape and out.lengths.shape == inp.lengths.shape
    assert torch.equal(out.page_table.long(), inp.page_table) and torch.equal(out.lengths.long(), inp.lengths)
    assert out.page_table.untyped_storage().data_ptr() == out.lengths.untyped_storage().data_ptr()  # one launch
    for name in ("flat", "tokens", "kda_slots", "row_base", "source", "stops"):
        assert getattr(out, name) is getattr(inp, name)


def test_parts_not_adjacent_are_converted_each(monkeypatch):
    monkeypatch.delenv(MLA_INT32_ENV, raising=False)
    inp = image()
    apart = DecodeInputs(inp.flat, inp.tokens, inp.kda_slots, inp.page_table.clone(), inp.lengths.clone(),
                         inp.row_base, inp.source, inp.stops)
    out = mla_index_int32(apart)
    assert torch.equal(out.page_table.long(), inp.page_table) and torch.equal(out.lengths.long(), inp.lengths)
    assert out.page_table.dtype == out.lengths.dtype == torch.int32
    assert out.page_table.shape == inp.page_table.shape and out.lengths.shape == inp.lengths.shape


def test_switch_off(monkeypatch):
    monkeypatch.setenv(MLA_INT32_ENV, "0")
    inp = image()
    assert mla_index_int32(inp) is inp


def test_parts_of_another_buffer_at_the_adjacent_offset_are_converted_each(monkeypatch):
    """lengths a view of another buffer that happens to start where the page table ends (the same offset in a
    different storage): the one-conversion path must not read past the table into its own storage."""
    monkeypatch.delenv(MLA_INT32_ENV, raising=False)
    inp = image()
    table = inp.page_table.clone()
    elsewhere = torch.full((table.numel() + inp.lengths.numel(),), 99, dtype=torch.int64)
    lengths = elsewhere[table.numel() :]
    lengths.copy_(inp.lengths)
    assert lengths.storage_offset() == table.storage_offset() + table.numel()
    apart = DecodeInputs(inp.flat, inp.tokens, inp.kda_slots, table, lengths, inp.row_base, inp.source, inp.stops)
    out = mla_index_int32(apart)
    assert torch.equal(out.page_table.long(), table) and torch.equal(out.lengths.long(), inp.lengths)
