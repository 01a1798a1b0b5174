"""DecodeInputBuilder keeps per-request rows across steps: over random sequences of batch compositions
(requests joining, leaving, reordering, growing their block tables, being admitted again with new pages,
verify windows of several rows per request, padding into reused buffers) every image it writes must equal
the image defined row by row (a plain-Python oracle) and a fresh builder's from-scratch image."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.prefix_index import Block
from k3core.cache.request import CachedRequest
from k3core.presets import preset
from services.engine.decode_inputs import STOP_WIDTH, DecodeInputBuilder

MAX_PAGES = 6
SCRATCH_KDA, SCRATCH_MLA = 0, 1
Row = namedtuple("Row", "rid blocks state_pages num_computed")  # a verify window's row (fast_verify's shape)


def _layout(name: str, hash_block: int):
    return plan_layout(shape_from_config(preset(name), name), 1, hash_block_tokens=hash_block)


LAYOUTS = {"nano": _layout("nano", 16), "mini": _layout("mini", 512)}  # 1 and 5 MLA groups


def oracle(layout, rows, tokens: list[int], size: int, lookahead: bool = False) -> np.ndarray:
    """The image by its definition (decode_inputs.DecodeInputs), one row at a time; with the look-ahead's
    parts (`source`, `stops`: -1, no look-ahead row) only for a look-ahead builder."""
    per_block, per_group = layout.tokens_per_block, layout.layers_per_group
    kda, mla = layout.num_kda_groups, layout.num_mla_groups
    tok, lengths = [0] * size, [1] * size
    slots = [[SCRATCH_KDA] * size for _ in range(kda)]
    table = [[[SCRATCH_MLA] * MAX_PAGES for _ in range(size)] for _ in range(mla)]
    base = [[SCRATCH_MLA * per_block * per_group] * size for _ in range(mla)]
    for i, row in enumerate(rows):
        tok[i], lengths[i] = tokens[i], row.num_computed + 1
        for g in range(kda):
            slots[g][i] = row.state_pages[g]
        for g in range(mla):
            for b, block in enumerate(row.blocks):
                table[g][i][b] = block.pages[g]
            page = row.blocks[row.num_computed // per_block].pages[g]
            base[g][i] = (page * per_block + row.num_computed % per_block) * per_group
    flat = tok + [s for g in slots for s in g] + [p for g in table for r in g for p in r] + lengths
    ahead = [-1] * (size * (1 + STOP_WIDTH)) if lookahead else []
    return np.array(flat + [b for g in base for b in g] + ahead, dtype=np.int64)


class Pages:
    def __init__(self) -> None:
        self.next = 2  # 0, 1: the scratch pages

    def take(self, count: int) -> list[int]:
        self.next += count
        return list(range(self.next - count, self.next))


def admit(layout, pages: Pages, rid: str, position: int, extra_block: bool) -> CachedRequest:
    req = CachedRequest(rid, layout.hash_block_tokens, state_pages=pages.take(layout.num_kda_groups))
    req.num_computed = position
    grow(layout, pages, req, extra_block)
    return req


def grow(layout, pages: Pages, req: CachedRequest, extra_block: bool) -> None:
    """Append blocks until the position's block exists (one more when reserved ahead)."""
    need = min(MAX_PAGES, req.num_computed // layout.tokens_per_block + 1 + extra_block)
    while len(req.blocks) < need:
        req.blocks.append(Block(len(req.blocks), pages.take(layout.num_mla_groups), lambda block: None))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_images_equal_the_definition_and_a_fresh_build(name, data):
    layout = LAYOUTS[name]
    limit = MAX_PAGES * layout.tokens_per_block - 4
    lookahead = data.draw(st.booleans())
    builder, pages = DecodeInputBuilder(layout, MAX_PAGES, SCRATCH_KDA, SCRATCH_MLA, lookahead), Pages()
    live: dict[str, CachedRequest] = {}
    buffers: dict[int, np.ndarray] = {}
    for step in range(data.draw(st.integers(1, 10))):
        for rid in list(live):
            action = data.draw(st.sampled_from(["advance", "advance", "jump", "readmit", "leave"]))
            req = live[rid]
            if action == "leave":
                del live[rid]
            elif action == "readmit":  # preempted and admitted again: new lists, same rid
                live[rid] = admit(layout, pages, rid, data.draw(st.integers(0, limit)), data.draw(st.booleans()))
            else:
                req.num_computed = min(limit, req.num_computed + (1 if action == "advance" else
                                                                  data.draw(st.integers(1, 2 * layout.tokens_per_block))))
                grow(layout, pages, req, data.draw(st.booleans()))
        for k in range(data.draw(st.integers(0, 3))):
            live[f"r{step}-{k}"] = admit(layout, pages, f"r{step}-{k}", data.draw(st.integers(0, limit)),
                                         data.draw(st.booleans()))
        order = data.draw(st.permutations(sorted(live)))
        chosen = [live[r] for r in order[: data.draw(st.integers(0, len(order)))]]
        rows: list = chosen
        if data.draw(st.booleans()):  # verify windows: rows sharing their request's lists, within its pages
            per_block = layout.tokens_per_block  # (the scheduler reserves a window's pages before it runs)
            rows = [Row(r.rid, r.blocks, r.state_pages, r.num_computed + j) for r in chosen
                    for j in range(min(data.draw(st.integers(1, 3)), len(r.blocks) * per_block - r.num_computed))]
        tokens = [data.draw(st.integers(0, 1000)) for _ in rows]
        size = len(rows) + data.draw(st.integers(0, 3))
        buffer = buffers.setdefault(size, np.full(builder.numel(size) + 5, -7, dtype=np.int64))
        got = builder.build(rows, tokens, size, out=buffer)
        expected = oracle(layout, rows, tokens, size, lookahead)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(DecodeInputBuilder(layout, MAX_PAGES, SCRATCH_KDA, SCRATCH_MLA, lookahead)
                                      .build(rows, tokens, size), expected)


def test_rows_of_finished_requests_are_reused():
    """Short-lived requests one after another: the arena stays bounded and every image stays right."""
    layout = LAYOUTS["mini"]
    builder, pages = DecodeInputBuilder(layout, MAX_PAGES, SCRATCH_KDA, SCRATCH_MLA), Pages()
    for i in range(400):
        reqs = [admit(layout, pages, f"q{i}-{j}", 10 * i + j, False) for j in range(3)]
        tokens = [i, i + 1, i + 2]
        np.testing.assert_array_equal(builder.build(reqs, tokens, 4), oracle(layout, reqs, tokens, 4))
    assert len(builder._filled) <= 128  # the rows of finished requests went back to the free list


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_prepared_images_refreshed_and_compacted_equal_the_definition(data):
    """The overlap's form (decode_overlap.py): `prepare` before the tokens (some rows' next position starts a
    block not reserved yet), a graph capture in between (a padding-only build), then those blocks reserved, the rows that ended dropped (`compact`, into another bucket's buffer or the
    same one), the new blocks written (`refresh`) and the tokens: the image of a fresh build of what is left."""
    layout = LAYOUTS[data.draw(st.sampled_from(sorted(LAYOUTS)))]
    per_block = layout.tokens_per_block
    lookahead = data.draw(st.booleans())
    builder, pages = DecodeInputBuilder(layout, MAX_PAGES, SCRATCH_KDA, SCRATCH_MLA, lookahead), Pages()
    reqs, crossing = [], []
    for i in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            req = admit(layout, pages, f"r{i}", data.draw(st.integers(1, MAX_PAGES - 1)) * per_block - 1, False)
            req.num_computed += 1  # its forward ran: the next token starts block len(blocks), not reserved yet
            crossing.append(i)
        else:
            req = admit(layout, pages, f"r{i}", data.draw(st.integers(0, MAX_PAGES * per_block - 1)), False)
        reqs.append(req)
    size = len(reqs) + data.draw(st.integers(0, 3))
    image = builder.prepare(reqs, size, out=np.full(builder.numel(size) + 5, -7, dtype=np.int64))
    builder.build([], [], 1)  # a graph captured between prepare and launch (padding rows only)
    keep = sorted(data.draw(st.sets(st.integers(0, len(reqs) - 1), min_size=1)))
    for i in crossing:
        grow(layout, pages, reqs[i], False)  # reserved
    size2 = len(keep) + data.draw(st.integers(0, 3))
    same = size2 == size and data.draw(st.booleans())
    out = image if same else np.full(builder.numel(size2) + 5, -7, dtype=np.int64)
    out = builder.compact(image, size, keep, out, size2)
    at = {i: k for k, i in enumerate(keep)}
    builder.refresh(out, size2, [reqs[i] for i in crossing if i in at], [at[i] for i in crossing if i in at])
    tokens = [data.draw(st.integers(0, 1000)) for _ in keep]
    builder.token_slots(out, len(keep))[:] = tokens
    np.testing.assert_array_equal(out, oracle(layout, [reqs[i] for i in keep], tokens, size2, lookahead))
