"""MXFP4 -> bf16 tile decoding (kernels.moe.mxfp4_tile_triton, on k3core.quant.mxfp4_device's layout) against
k3core's dequantize, interpreted."""

from __future__ import annotations

import pytest
import torch

from k3core.quant.mxfp4 import dequantize
from k3core.quant.mxfp4_device import decode_multipliers, device_words
from kernels._triton import tl, triton
from kernels.moe.mxfp4_tile_triton import SHIFT, mxfp4_tile, prepare

ROWS, GROUPS = 64, 8  # 64 rows x 256 columns (2 x 2 stored blocks): every code in every row, 8 scales a row


@triton.jit
def tile_kernel(words, mults, out, R: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, R)
    t = mxfp4_tile(words, mults, rows, rows < R, 0, WORDS, WORDS // 4, False)
    tl.store(out + rows[:, None] * (8 * WORDS) + tl.arange(0, 8 * WORDS)[None, :], t.to(tl.float32))


def _decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Whole matrix through `prepare` (32-row blocks) and `mxfp4_tile`, positions in the tile's order, times
    2^SHIFT, as float64."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2)
    words = packed.shape[1] // 4
    tile_kernel[(1,)](*prepare(packed, scales), out, R=packed.shape[0], WORDS=words)
    return out.double() * 2.0**SHIFT


def _tile_order(n: int) -> torch.Tensor:
    """The column each tile position holds (the documented order, written out independently): position
    8 s + p holds column 8 w + p // 2 + 4 (p % 2), where word slot s = 16 a + 4 b + q takes word w = 4 (4 a +
    q) + b (word b of group 4 a + q) when the tile's groups are a multiple of 4, else w = s."""
    pos = torch.arange(n)
    s, p = pos // 8, pos % 8
    w = 4 * (4 * (s // 16) + s % 4) + (s // 4) % 4 if (n // 32) % 4 == 0 else s
    return 8 * w + p // 2 + 4 * (p % 2)


def _all_codes(gen: torch.Generator) -> torch.Tensor:
    """uint8 [ROWS, 16 GROUPS] packed bytes: each row holds all 16 e2m1 codes in a shuffled order."""
    codes = torch.stack([torch.randperm(16, generator=gen).repeat(2 * GROUPS) for _ in range(ROWS)])
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def test_tile_equals_dequantize_for_every_code_across_the_exact_scale_range(interpreted):
    """Bit-exact for all 16 codes (the e2m1 subnormal 0.5 and -0 included) at scales 2^-93 .. 2^33, from
    blocked storage (2 x 2 blocks)."""
    gen = torch.Generator().manual_seed(0)
    packed = _all_codes(gen)
    scales = torch.randint(34, 161, (ROWS, GROUPS), generator=gen, dtype=torch.uint8)
    scales[0] = torch.tensor([34, 127, 160, 100, 34, 160, 127, 99], dtype=torch.uint8)  # the exact range's ends
    expected = dequantize(packed, scales, torch.float64)[:, _tile_order(32 * GROUPS)]
    got = _decode(packed, scales)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # -0 stays -0


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # 0 x inf = NaN, as wanted
def test_tile_is_non_finite_where_the_scale_is_nan_or_too_large(interpreted):
    """The 0xFF (NaN) scale and scales above 2^33 cannot be represented: they decode to +-inf / NaN, never
    to finite numbers, while the other groups of the row stay exact."""
    packed = _all_codes(torch.Generator().manual_seed(1))
    scales = torch.full((ROWS, GROUPS), 127, dtype=torch.uint8)
    scales[:, 1], scales[:, 2] = 0xFF, 200
    got = _decode(packed, scales)
    order = _tile_order(32 * GROUPS)
    bad = (order // 32 == 1) | (order // 32 == 2)  # positions holding columns of groups 1 and 2
    assert not torch.isfinite(got[:, bad]).any()
    torch.testing.assert_close(got[:, ~bad], dequantize(packed, scales, torch.float64)[:, order][:, ~bad],
                               rtol=0, atol=0)


@pytest.mark.parametrize("n", [32, 64, 128, 256])
def test_tile_order_is_a_permutation(n):
    assert sorted(_tile_order(n).tolist()) == list(range(n))


def test_a_lane_holds_one_group_per_four_words():
    """With 4 groups, the 8-column chunk q of every 32-column block comes from group q: a tensor-core lane
    (which holds chunk q of each block) needs one multiplier for its 4 words."""
    groups = _tile_order(128).reshape(4, 4, 8) // 32  # [block, chunk q, position]
    assert torch.equal(groups, torch.arange(4)[None, :, None].expand(4, 4, 8))


def test_blocked_storage_is_a_permutation_of_the_row_layout():
    """Same bytes as the row-by-row device layout: each 32-row x 16-word block (2 KB) and its 32 x 4
    multipliers are contiguous, the blocks of a 32-row band in column order, the bands in row order."""
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8)  # 64 rows x 32 words
    scales = torch.randint(100, 140, (64, 8), dtype=torch.uint8)
    rows_w, rows_m = device_words(packed), decode_multipliers(scales, SHIFT)
    words, mults = prepare(packed, scales)
    assert words.shape == rows_w.shape and mults.shape == rows_m.shape
    for block in range(4):
        band, col = divmod(block, 2)
        assert torch.equal(words.flatten()[512 * block:512 * (block + 1)].view(32, 16),
                           rows_w[32 * band:32 * (band + 1), 16 * col:16 * (col + 1)])
        assert torch.equal(mults.flatten()[128 * block:128 * (block + 1)].view(32, 4),
                           rows_m[32 * band:32 * (band + 1), 4 * col:4 * (col + 1)])
