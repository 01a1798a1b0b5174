"""The one-launch AttnRes phase 1 (kernels/attnres/phase1_triton.py): a block completes (its logits against
every later site into the cache, optionally copied into the block buffer) and the phase 1 of the next
sites follows, in one launch. Held to float64 math (eq.8-9) and to the two-launch form it replaces
(block_logits then the apply kernel over cached logits), which it must equal bit for bit: the same jitted
functions do the same sums in the same order. Interpreted on the CPU (the two roles as two launches);
compiled on the GPU (one launch, programs ordered by tickets).
"""

from __future__ import annotations

import pytest
import torch

from kernels.attnres import block_logits_triton, inter_triton, phase1_triton
from kernels.attnres.query_parts import query_parts
from tests.kernels.test_attnres_inter import _float64_logits, _float64_stats

CASES = [  # (blocks N, rows, D, later sites S, this phase's sites Q, launcher arguments)
    (3, 5, 48, 7, 4, {"logits_chunks": 3}),  # D chunks of the logits added by a tile's last program
    (1, 6, 32, 70, 5, {"logits_chunks": 2}),  # the first block: two sites tiles, only the first waited for
    (4, 20, 40, 3, 3, {"logits_rows": 16, "apply_rows": 4, "apply_chunks": 2}),  # partial rows tiles
    (2, 3, 32, 1, 1, {}),  # the final site alone, default tiles
]


def _serving_case(n_blocks: int, rows: int, dim: int, later: int, device: str = "cpu", scale: float = 1.0):
    """Blocks (the newest last, and also apart as the sublayers' sum), the later sites' parameters, and a
    logit cache whose earlier columns hold those blocks' logits."""
    gen = torch.Generator(device=device).manual_seed(n_blocks * 1000 + rows + dim + later)
    blocks = (torch.randn(n_blocks, rows, dim, generator=gen, device=device) * 3).bfloat16()
    queries = (torch.randn(later, dim, generator=gen, device=device) * scale).bfloat16()
    norm_w = (torch.rand(later, dim, generator=gen, device=device) + 0.5).bfloat16()
    cache = torch.full((later, n_blocks, rows), float("nan"), device=device)
    for n in range(n_blocks - 1):
        cache[:, n] = _float64_logits(queries, blocks[n], norm_w).float()
    return blocks, queries, norm_w, cache


def _two_launches(blocks, queries, norm_w, cache, sites: int, **kwargs):
    """What the one launch replaces: the newest block's logits, then the apply over the cached logits."""
    tuning = {"rows": kwargs.get("logits_rows"), "chunks": kwargs.get("logits_chunks"), "block_d": 16}
    block_logits_triton.attnres_block_logits(queries, blocks[-1], norm_w, out=cache[:, -1],
                                             parts=query_parts(queries, norm_w), **tuning)
    chunks = (1, kwargs["apply_chunks"]) if "apply_chunks" in kwargs else None
    return inter_triton.attnres_inter(queries[:sites], blocks, norm_w[:sites], logits=cache[:sites],
                                      apply_rows=kwargs.get("apply_rows", 2), apply_block_d=16, chunks=chunks)


@pytest.mark.parametrize(("n_blocks", "rows", "dim", "later", "sites", "kwargs"), CASES)
def test_one_launch_equals_two_launches_and_float64(interpreted, n_blocks, rows, dim, later, sites, kwargs):
    blocks, queries, norm_w, cache = _serving_case(n_blocks, rows, dim, later)
    newest = blocks[-1].clone()
    buffer = blocks.clone()
    buffer[-1] = 0  # copy=True must write the newest block into its place
    ours = phase1_triton.attnres_inter_with_newest(queries, newest, buffer, cache, norm_w, sites=sites,
                                                   parts=query_parts(queries, norm_w), copy=True,
                                                   logits_block_d=16, apply_block_d=16, **kwargs)
    assert torch.equal(buffer, blocks)
    new_column = cache[:, -1].clone()
    torch.testing.assert_close(new_column.double(), _float64_logits(queries, newest, norm_w), rtol=2e-6, atol=2e-5)
    want = _float64_stats(queries[:sites], blocks, norm_w[:sites])
    for got, w64 in zip((ours.max, ours.denom, ours.acc), want, strict=True):
        assert got.dtype == torch.float32 and got.shape == w64.shape
        torch.testing.assert_close(got.double(), w64, rtol=2e-6, atol=2e-5)
    cache[:, -1] = float("nan")
    two = _two_launches(blocks, queries, norm_w, cache, sites, **kwargs)
    assert torch.equal(cache[:, -1], new_column)
    for got, ref in zip((ours.max, ours.denom, ours.acc), (two.max, two.denom, two.acc), strict=True):
        assert torch.equal(got, ref)


def test_bad_arguments_name_the_argument(interpreted):
    blocks, queries, norm_w, cache = _serving_case(2, 3, 16, 4)
    call = phase1_triton.attnres_inter_with_newest
    with pytest.raises(ValueError, match="sites"):
        call(queries, blocks[-1], blocks, cache, norm_w, sites=5)
    with pytest.raises(ValueError, match="blocks"):
        call(queries, blocks[-1], blocks.float(), cache, norm_w)
    with pytest.raises(ValueError, match="logits"):
        call(queries, blocks[-1], blocks, cache[:, :1], norm_w)


@pytest.mark.gpu
@pytest.mark.parametrize(("n_blocks", "rows", "dim", "later", "sites"),
                         [(8, 64, 7168, 25, 24), (2, 64, 7168, 163, 24), (4, 64, 2048, 3, 2), (8, 4100, 512, 25, 24)])
def test_compiled_one_launch_matches_two_launches_on_gpu(n_blocks, rows, dim, later, sites):
    """Compiled, one launch with tickets (K3 decode: the last block, an early block with 163 later sites;
    mini's last phase; 514 logits items, more than fit on the H200 at once: the first ticket scheme hung
    there), run twice (the counters must be back at zero): bit for bit the two-launch form, and float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    blocks, queries, norm_w, cache = _serving_case(n_blocks, rows, dim, later, "cuda", dim**-0.5)
    parts = query_parts(queries, norm_w)
    for _ in range(2):
        buffer = blocks.clone()
        buffer[-1] = 0
        ours = phase1_triton.attnres_inter_with_newest(queries, blocks[-1].clone(), buffer, cache, norm_w,
                                                       sites=sites, parts=parts, copy=True)
        assert torch.equal(buffer, blocks)
        new_column = cache[:, -1].clone()
        torch.testing.assert_close(new_column.double(), _float64_logits(queries, blocks[-1], norm_w), rtol=1e-5,
                                   atol=1e-5)
        want = _float64_stats(queries[:sites], blocks, norm_w[:sites])
        for got, w64 in zip((ours.max, ours.denom, ours.acc), want, strict=True):
            torch.testing.assert_close(got.double(), w64, rtol=1e-5, atol=5e-5 * w64.abs().max().item())
    block_logits_triton.attnres_block_logits(queries, blocks[-1], norm_w, out=cache[:, -1], parts=parts)
    assert torch.equal(cache[:, -1], new_column)
    two = inter_triton.attnres_inter(queries[:sites], blocks, norm_w[:sites], logits=cache[:sites])
    for got, ref in zip((ours.max, ours.denom, ours.acc), (two.max, two.denom, two.acc), strict=True):
        assert torch.equal(got, ref)


def test_bench_counts_the_served_phases_and_their_bytes():
    """kernels/perf/attnres_cases: the phase 1s of a decode forward, hand-derived from the presets (K3: 93
    layers in blocks of 12, two sites a layer and the final one; mini: 17 layers in blocks of 8), and the
    least bytes of K3's fixed bench shape at decode, by hand."""
    from kernels.perf.attnres_cases import forward_phases, phase1_bytes

    k3 = [(n, 24, 187 - 24 * (n - 1)) for n in range(1, 8)] + [(8, 18, 19), (9, 1, 1)]
    assert forward_phases("k3") == k3
    assert forward_phases("mini") == [(1, 16, 35), (2, 16, 19), (3, 2, 3), (4, 1, 1)]
    blocks, accumulators, stats = 8 * 64 * 7168 * 2, 24 * 64 * 7168 * 4, 24 * 64 * 2 * 4
    cached, new, parts = 24 * 7 * 64 * 4, 25 * 64 * 4, 2 * 25 * 7168 * 2
    assert phase1_bytes(64, 7168, 8, 24, 25) == blocks + accumulators + stats + cached + new + parts
    assert phase1_bytes(64, 7168, 8, 24, 25, copy=True) - phase1_bytes(64, 7168, 8, 24, 25) == 64 * 7168 * 2
