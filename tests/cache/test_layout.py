"""Pool sizing: one page size for both caches, blocks on the hash grid, per-head contiguous KDA bytes."""

from __future__ import annotations

import pytest
import torch

from k3core.cache.layout import choose_layers_per_group, plan_layout, shape_from_config
from k3core.cache.page_store import PageStore
from k3core.cache.pool import PageKind, PagePool
from k3core.cache.sizing_report import format_table, layout_rows
from k3core.presets import preset


def test_k3_sizing_by_hand() -> None:
    shape = shape_from_config(preset("k3"), "k3")
    lay = plan_layout(shape, tp=1)
    # 96 heads x 24 layers x (128*128*4 recurrent + 3*128*3*2 conv) bytes = 156,303,360 for a KDA page;
    # an MLA token of 24 layers is 24 * 576 * 2 = 27,648 bytes -> 5,654 tokens -> 12 hash blocks of 512.
    assert lay.layers_per_group == 24 and (lay.num_kda_groups, lay.num_mla_groups) == (3, 1)
    assert lay.kda_page_used_bytes == 96 * 24 * (65536 + 2304) == 156_303_360
    assert lay.tokens_per_block == 6144 and lay.page_bytes == 6144 * 27_648
    tp8 = plan_layout(shape, tp=8)
    assert tp8.heads_per_rank == 12 and tp8.tokens_per_block == 1024
    assert plan_layout(shape, tp=8, hash_block_tokens=1536).tokens_per_block == 1536


@pytest.mark.parametrize("name", ["nano", "mini", "k3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_page_fits_and_blocks_sit_on_the_hash_grid(name: str, tp: int) -> None:
    lay = plan_layout(shape_from_config(preset(name), name), tp=tp)
    assert lay.tokens_per_block % lay.hash_block_tokens == 0
    assert lay.kda_page_used_bytes <= lay.page_bytes == lay.mla_page_used_bytes
    # the physical block is the smallest on the hash grid that holds a KDA page
    assert (lay.tokens_per_block - lay.hash_block_tokens) * lay.layers_per_group * lay.mla_token_bytes \
        < lay.kda_page_used_bytes or lay.tokens_per_block == lay.hash_block_tokens


def test_group_size_choice() -> None:
    assert choose_layers_per_group(69, 24) == 24
    assert choose_layers_per_group(6, 3) == 3
    assert choose_layers_per_group(12, 5) == 1  # mini: any larger group would waste > 5 % of slots


def test_bad_tp_is_rejected() -> None:
    with pytest.raises(ValueError, match="tp=7"):
        plan_layout(shape_from_config(preset("k3")), tp=7)


def test_printer_covers_presets_at_tp_1_and_8() -> None:
    table = format_table(layout_rows())
    assert "| k3 | 8 |" in table and "| mini | 8 |" in table and "| nano | 1 |" in table


def test_each_head_owns_one_contiguous_byte_range() -> None:
    lay = plan_layout(shape_from_config(preset("nano"), "nano"), tp=1, hash_block_tokens=16)
    pool = PagePool(2)
    store = PageStore(lay, pool, debug=True)
    page = pool.allocate(PageKind.KDA, 0)[0]
    for head in range(lay.heads_per_rank):
        store.zero(page)
        for slot in range(lay.layers_per_group):
            conv, rec = store.kda_views(page, slot)
            rec[head].fill_(1.0)
            conv[:, head].fill_(1.0)
        touched = store.data[page].nonzero().flatten()
        lo, hi = store.head_range(head)
        assert int(touched.min()) >= lo and int(touched.max()) < hi
    assert store.head_range(lay.heads_per_rank - 1)[1] == lay.kda_page_used_bytes
    assert torch.count_nonzero(store.data[page, lay.kda_page_used_bytes :]) == 0
