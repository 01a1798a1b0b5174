"""Paged MLA decode: reference vs float64 softmax attention, Triton split-KV (interpreted) vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.mla import decode_triton, naive

R, P, PAGE = 32, 16, 8


def _paged_case(seed: int, lengths: list[int], heads: int = 3):
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = max(-(-n // PAGE) for n in lengths)
    num_pages = len(lengths) * pages_per_seq + 3
    cache = torch.randn(num_pages, PAGE, R + P, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[: len(lengths) * pages_per_seq]
    q = torch.randn(len(lengths), heads, R + P, generator=gen)
    return q, cache, table.reshape(len(lengths), pages_per_seq).int(), torch.tensor(lengths).int()


def test_reference_matches_float64_attention():
    q, cache, table, lengths = _paged_case(0, [5, 19])
    out = naive.mla_decode_paged(q, cache, table, lengths, 0.3, latent_dim=R)
    for b, n in enumerate(lengths.tolist()):
        rows = cache.double()[table[b].long()].reshape(-1, R + P)[:n]  # gathered by hand
        probs = torch.softmax(0.3 * q[b].double() @ rows.T, dim=-1)
        torch.testing.assert_close(out[b].double(), probs @ rows[:, :R], rtol=1e-5, atol=1e-6)


# block 8 = PAGE: whole-page tiles (one page-table read per tile); 16 and 32 span pages: per-row gathers.
@pytest.mark.parametrize(("splits", "block", "tokens_major"),
                         [(1, 16, False), (3, 16, True), (4, 32, False), (2, 8, False), (3, 8, True)])
def test_triton_split_kv_matches_reference(interpreted, splits, block, tokens_major):
    q, cache, table, lengths = _paged_case(1, [1, 17, 40, 9])
    out = decode_triton.mla_decode_paged(q, cache, table, lengths, 0.2, latent_dim=R, num_splits=splits,
                                         block_n=block, tokens_major=tokens_major)
    ref = naive.mla_decode_paged(q, cache, table, lengths, 0.2, latent_dim=R)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_more_splits_than_rows_is_still_exact(interpreted):
    """Empty splits (a split range past the sequence end) must not disturb the merge."""
    q, cache, table, lengths = _paged_case(2, [2, 3])
    out = decode_triton.mla_decode_paged(q, cache, table, lengths, 0.2, latent_dim=R, num_splits=8)
    torch.testing.assert_close(out, naive.mla_decode_paged(q, cache, table, lengths, 0.2, latent_dim=R),
                               rtol=1e-5, atol=1e-5)


def test_page_tiles_and_row_gathers_agree(interpreted):
    """Forcing per-row gathers where whole-page tiles apply gives the same result; forcing page tiles on a
    tile that spans pages is refused."""
    q, cache, table, lengths = _paged_case(4, [8, 23, 16])
    args = (q, cache, table, lengths, 0.2)
    tiled = decode_triton.mla_decode_paged(*args, latent_dim=R, num_splits=2, block_n=8)
    gathered = decode_triton.mla_decode_paged(*args, latent_dim=R, num_splits=2, block_n=8, page_tiles=False)
    torch.testing.assert_close(tiled, gathered, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="page_tiles"):
        decode_triton.mla_decode_paged(*args, latent_dim=R, block_n=16, page_tiles=True)


@pytest.mark.parametrize(("batch", "capacity", "want"), [(1, 65536, 256), (16, 65536, 16), (64, 4096, 4),
                                                         (256, 65536, 1), (3, 640, 5), (3, 8192, 64)])
def test_default_splits_fill_the_gpu_without_tiny_splits(batch, capacity, want):
    """With the default 32-row tile: ~2 programs per SM (264 / batch) rounded to a power of two, unless that
    leaves a split under 4 tiles: then the cap capacity // 128, any count (5 at 3 sequences over 640 tokens)."""
    splits = decode_triton.default_splits(batch, capacity, 32)
    assert splits == want
    assert splits == 1 or capacity // splits >= 4 * 32  # at least four tiles per split
    power = splits & (splits - 1) == 0
    assert (power and 0.7 * 264 <= batch * splits <= 1.42 * 264) or splits == capacity // 128 or splits == 1


@pytest.mark.parametrize(
    ("edit", "field"),
    [(lambda a: {**a, "cache": a["cache"][..., :40]}, "cache"),
     (lambda a: {**a, "page_table": a["page_table"][:1]}, "page_table"),
     (lambda a: {**a, "lengths": a["lengths"][:1]}, "lengths")],
)
def test_bad_input_names_the_field(interpreted, edit, field):
    q, cache, table, lengths = _paged_case(3, [4, 4])
    args = edit({"q": q, "cache": cache, "page_table": table, "lengths": lengths})
    with pytest.raises(ValueError, match=field):
        decode_triton.mla_decode_paged(**args, scale=0.1, latent_dim=R)
