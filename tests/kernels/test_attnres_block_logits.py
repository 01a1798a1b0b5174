"""Block AttnRes logits computed once per block (kernels/attnres/block_logits_triton.py), and phase 1 from
those cached logits (inter_triton.attnres_inter(..., logits=...)), in the Triton interpreter against float64
math: a block's logits against later sites, written into a slice of a logit cache, then each block's phase 1
softmaxes the cached column of every completed block; the result must be eq.9's statistics.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kernels.attnres import block_logits_triton, inter_triton
from kernels.attnres.query_parts import query_parts
from tests.kernels.test_attnres_inter import _float64_logits, _float64_softmax, _float64_stats

CASES = [  # (rows shape, D, sites S, dtype, key-norm weights, launcher arguments)
    ((5,), 48, 4, torch.bfloat16, True, {"chunks": 3}),  # D chunks added by the last program of a tile
    ((20,), 40, 20, torch.bfloat16, False, {"rows": 16, "sites": 16}),  # partial row and site tiles
    ((2, 3), 64, 7, torch.float32, True, {"chunks": 2}),  # 3xTF32 path, rows of two dims
    ((3,), 32, 1, torch.bfloat16, True, {}),  # the final site alone, default tiles
]


@pytest.mark.parametrize(("rows", "dim", "sites", "dtype", "with_norm_w", "kwargs"), CASES)
def test_block_logits_match_float64(interpreted, rows, dim, sites, dtype, with_norm_w, kwargs):
    gen = torch.Generator().manual_seed(dim + sites)
    block = (torch.randn(*rows, dim, generator=gen) * 3).to(dtype)
    queries = torch.randn(sites, dim, generator=gen)
    norm_w = torch.rand(sites, dim, generator=gen) + 0.5 if with_norm_w else None
    want = _float64_logits(queries, block, norm_w)
    for _ in range(2):  # the tile counters are left at zero for the next launch
        got = block_logits_triton.attnres_block_logits(queries, block, norm_w, block_d=16, **kwargs)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize(("q_dtype", "w_dtype", "count"), [(torch.bfloat16, torch.bfloat16, 2),
                                                            (torch.bfloat16, None, 1), (torch.float32, torch.bfloat16, 3)])
def test_query_parts_sum_to_the_effective_query_exactly(q_dtype, w_dtype, count):
    """The parts add up to q_eff = float32(query) * float32(weight) bit for bit (float64 sums are exact here),
    including tiny and huge magnitudes; bf16 x bf16 needs 2 parts, a bf16 query alone 1, float32 3."""
    gen = torch.Generator().manual_seed(count)
    queries = (torch.randn(5, 64, generator=gen) * torch.logspace(-30, 30, 64)).to(q_dtype)
    norm_w = (torch.rand(5, 64, generator=gen) * 4 - 2).to(w_dtype) if w_dtype is not None else None
    parts = query_parts(queries, norm_w)
    assert parts.shape == (count, 5, 64) and parts.dtype == torch.bfloat16
    q_eff = queries.float() * norm_w.float() if norm_w is not None else queries.float()
    assert torch.equal(parts.double().sum(0), q_eff.double())


@pytest.mark.parametrize(("rows", "chunks"), [(5, 3), (40, None)])
def test_precomputed_parts_give_the_same_logits(interpreted, rows, chunks):
    gen = torch.Generator().manual_seed(rows)
    block = (torch.randn(rows, 48, generator=gen) * 3).bfloat16()
    queries, norm_w = torch.randn(20, 48, generator=gen).bfloat16(), (torch.rand(20, 48, generator=gen) + 0.5).bfloat16()
    kwargs = {"block_d": 16, "chunks": chunks, "rows": 16, "sites": 16}  # two site tiles: parts addressed per tile
    got = block_logits_triton.attnres_block_logits(queries, block, norm_w, parts=query_parts(queries, norm_w), **kwargs)
    torch.testing.assert_close(got.double(), _float64_logits(queries, block, norm_w), rtol=2e-6, atol=2e-5)
    later = block_logits_triton.attnres_block_logits(queries[3:], block, norm_w[3:],  # the sites after one
                                                     parts=query_parts(queries, norm_w)[:, 3:], **kwargs)
    torch.testing.assert_close(later, got[3:], rtol=0, atol=0)
    # the parts really are what the kernel multiplies: parts of 2 x the queries (exact in bf16) double the logits
    doubled = block_logits_triton.attnres_block_logits(queries, block, norm_w, parts=query_parts(2 * queries, norm_w),
                                                       **kwargs)
    torch.testing.assert_close(doubled, 2 * got, rtol=0, atol=0)


def test_cached_logits_give_phase_one(interpreted):
    """The serving order: each block's logits against the sites after it go into a cache [sites, blocks,
    rows] once; each block's phase 1 reads the cached columns of the blocks before it and equals eq.9's
    statistics (float64) and the two-kernel form that scores all blocks again (1e-6)."""
    gen = torch.Generator().manual_seed(3)
    n_blocks, per_block, rows, dim = 4, 3, 6, 48  # sites 0..2 read block 0, 3..5 blocks 0-1, ...
    sites = n_blocks * per_block
    blocks = (torch.randn(n_blocks, rows, dim, generator=gen) * 2).bfloat16()
    queries, norm_w = torch.randn(sites, dim, generator=gen), torch.rand(sites, dim, generator=gen) + 0.5
    cache = torch.full((sites, n_blocks, rows), float("nan"))
    for j in range(n_blocks):
        later = slice(j * per_block, sites)  # block j is complete before site j * per_block
        block_logits_triton.attnres_block_logits(queries[later], blocks[j], norm_w[later], out=cache[later, j],
                                                 block_d=16, chunks=2)
    for k in range(1, n_blocks + 1):
        site_range = slice((k - 1) * per_block, k * per_block)  # the sites that see blocks 0..k-1
        q, w = queries[site_range], norm_w[site_range]
        got = inter_triton.attnres_inter(q, blocks[:k], w, apply_block_d=16, logits=cache[site_range, :k])
        rescored = inter_triton.attnres_inter(q, blocks[:k], w, block_d=16, apply_block_d=16)
        want = _float64_stats(q, blocks[:k], w)
        for g, r, w64 in zip((got.max, got.denom, got.acc), (rescored.max, rescored.denom, rescored.acc), want,
                             strict=True):
            torch.testing.assert_close(g.double(), w64, rtol=2e-6, atol=2e-5)
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_phase_one_softmaxes_the_given_logits(interpreted):
    """With `logits=` the apply kernel takes exactly those (here numbers unrelated to the blocks, from a strided
    slice of a cache): a launcher that scored the blocks again would not match."""
    gen = torch.Generator().manual_seed(5)
    blocks = (torch.randn(3, 5, 32, generator=gen) * 2).bfloat16()
    queries, cache = torch.randn(4, 32, generator=gen), torch.randn(6, 4, 5, generator=gen) * 3
    logits = cache[1:5, :3]
    got = inter_triton.attnres_inter(queries, blocks, logits=logits, apply_block_d=16)
    want = _float64_softmax(logits, blocks)
    for g, w64 in zip((got.max, got.denom, got.acc), want, strict=True):
        torch.testing.assert_close(g.double(), w64, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize(("rows", "dtype", "kwargs"), [
    (40, torch.bfloat16, {"chunks": 3, "rows": 16, "sites": 16}),  # 3 row tiles x 2 site tiles x 3 D chunks
    (5, torch.bfloat16, {"chunks": 1}),  # one tile, unchunked (prefill-like): copied by torch first
    (6, torch.float32, {"chunks": 2}),  # no bf16 parts: copied by torch first
])
def test_copy_to_gets_the_block_and_the_logits_stay(interpreted, rows, dtype, kwargs):
    """`copy_to` (the block's slot in the buffer of completed blocks): every element of the block lands there
    (in the kernel: once per row tile and D chunk, by the first sites tile only), nothing else of the buffer
    changes, and the logits are those of the launch without it."""
    gen = torch.Generator().manual_seed(rows)
    block = (torch.randn(rows, 48, generator=gen) * 3).to(dtype)
    queries, norm_w = torch.randn(20, 48, generator=gen).bfloat16(), (torch.rand(20, 48, generator=gen) + 0.5).bfloat16()
    parts = query_parts(queries, norm_w) if dtype == torch.bfloat16 else None
    plain = block_logits_triton.attnres_block_logits(queries, block, norm_w, block_d=16, parts=parts, **kwargs)
    buffer = torch.full((3, rows, 48), float("nan"), dtype=dtype)
    got = block_logits_triton.attnres_block_logits(queries, block, norm_w, block_d=16, parts=parts,
                                                   copy_to=buffer[1], **kwargs)
    assert torch.equal(buffer[1], block)
    assert buffer[0].isnan().all() and buffer[2].isnan().all()
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="copy_to"):
        block_logits_triton.attnres_block_logits(queries, block, norm_w, parts=parts, copy_to=buffer[1, :, :16])


def test_out_slice_leaves_the_rest_of_the_cache(interpreted):
    gen = torch.Generator().manual_seed(9)
    block, queries = torch.randn(5, 32, generator=gen).bfloat16(), torch.randn(6, 32, generator=gen)
    cache = torch.full((6, 3, 5), 7.0)
    block_logits_triton.attnres_block_logits(queries[2:], block, out=cache[2:, 1], block_d=16)
    torch.testing.assert_close(cache[2:, 1].double(), _float64_logits(queries[2:], block, None), rtol=2e-6, atol=2e-5)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[2:, 1] = False
    assert (cache[untouched] == 7.0).all()


def test_bad_arguments_name_the_argument(interpreted):
    block, queries = torch.randn(4, 16), torch.randn(3, 16)
    with pytest.raises(ValueError, match="queries"):
        block_logits_triton.attnres_block_logits(torch.randn(3, 15), block)
    with pytest.raises(ValueError, match="norm_weights"):
        block_logits_triton.attnres_block_logits(queries, block, torch.randn(2, 16))
    with pytest.raises(ValueError, match="out"):
        block_logits_triton.attnres_block_logits(queries, block, out=torch.empty(3, 5))
    with pytest.raises(ValueError, match="rows"):
        block_logits_triton.attnres_block_logits(queries, block, rows=8)
    with pytest.raises(ValueError, match="logits"):
        inter_triton.attnres_inter(queries, torch.randn(2, 4, 16), logits=torch.empty(3, 1, 4))
    with pytest.raises(ValueError, match="parts"):
        block_logits_triton.attnres_block_logits(queries, block, parts=torch.zeros(1, 3, 16, dtype=torch.bfloat16))


def test_outgrown_tile_counters_stay_allocated():
    """A CUDA graph keeps the counters it was captured with: when a larger launch grows them, the old tensor
    must stay allocated (freed, its memory goes to other tensors, which the graph's atomics then change)."""
    cpu = torch.device("cpu")
    captured = block_logits_triton._counters(cpu, 8)
    alive = weakref.ref(captured)
    del captured
    block_logits_triton._counters(cpu, 1 << 16)
    gc.collect()
    assert alive() is not None


def test_unchunked_launch_asks_for_no_counters(monkeypatch, launch_grids):
    """Prefill-sized blocks fill the device without D chunks: the kernel then touches no counter, so none is
    asked of the shared scratch (one per tile would grow it with M, and be refused inside a graph capture)."""
    asked, grids = [], launch_grids(block_logits_triton, "_block_logits_kernel")
    monkeypatch.setattr(block_logits_triton, "split_scratch",
                        lambda floats, tiles, device: asked.append(tiles) or (torch.zeros(1), torch.zeros(1)))
    for rows, dim in ((64, 7168), (1 << 17, 256)):  # decode: D chunks; prefill: 2048 x 2 tiles, one chunk
        block_logits_triton.attnres_block_logits(torch.zeros(100, dim), torch.zeros(rows, dim, dtype=torch.bfloat16))
    assert grids[0][2] > 1 and asked[0] == grids[0][0] * grids[0][1]
    assert grids[1] == (2048, 2, 1) and asked[1] <= 1


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "dim"), [(64, 7168), (37, 200), (4100, 512)])
def test_compiled_cached_phase_one_matches_float64_on_gpu(rows, dim):
    """Compiled (bf16 MMAs on split parts, D chunks reduced by the last program of a tile at decode sizes):
    the newest block's logits and phase 1 from the cache, against float64 math at serving-sized D."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n_blocks, sites = 8, 24
    gen = torch.Generator(device="cuda").manual_seed(rows)
    blocks = (torch.randn(n_blocks, rows, dim, generator=gen, device="cuda") * 3).bfloat16()
    queries = torch.randn(sites + 1, dim, generator=gen, device="cuda").bfloat16() * dim**-0.5
    norm_w = (torch.rand(sites + 1, dim, generator=gen, device="cuda") + 0.5).bfloat16()
    cache = torch.empty(sites + 1, n_blocks, rows, device="cuda")
    parts = query_parts(queries, norm_w)
    for n in range(n_blocks):
        block_logits_triton.attnres_block_logits(queries, blocks[n], norm_w, out=cache[:, n],
                                                 parts=parts if n % 2 else None)  # both forms
        torch.testing.assert_close(cache[:, n].double(), _float64_logits(queries, blocks[n], norm_w),
                                   rtol=1e-5, atol=1e-5)
    got = inter_triton.attnres_inter(queries[:sites], blocks, norm_w[:sites], logits=cache[:sites])
    want = _float64_stats(queries[:sites], blocks, norm_w[:sites])
    for g, w64 in zip((got.max, got.denom, got.acc), want, strict=True):
        torch.testing.assert_close(g.double(), w64, rtol=1e-5, atol=5e-5 * w64.abs().max().item())
