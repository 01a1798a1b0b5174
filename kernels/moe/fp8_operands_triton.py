"""The FP8 decode kernels' operands (kernels.moe.decode_fp8_gluon, decode_fp8_down_gluon): MXFP4 weights in
k3core.quant.mxfp4_device's e4m3 layout, prepared once per weight load, and the activations split into two
e4m3 parts in the MMAs' K order (a Triton kernel, with its CPU reference).

The activations are e4m3 too: `split_activations` writes, per token, x / s = hi + lo (both e4m3, one
power-of-two s a token row; ~8 significant bits like bf16) with each 32-column block's columns in the MMA's
K order, so that the gate/up program copies them straight into the MMA's shared tiles. Two MMAs (hi, lo)
per group into one float32 tmp.

K order (per 32-column block = scale group G of a 128-column step): lane t of a quad holds word b = t of the
group for its rows (stored words transposed: word b of group G at position 4 b + G of the row's 16, see
`prepare_weights`); its register h (codes 4 h .. 4 h + 3 of the word, byte i = code 4 h + i) is the MMA's
k = 16 h + 4 t + i, i.e. column 8 t + 4 h + i of the block.
"""

from __future__ import annotations

import torch

from k3core.quant.mxfp4_device import device_words_e4m3, e4m3_multipliers
from kernels._triton import next_pow2, require, tl, triton
from kernels.moe.mxfp4_tile_triton import BLOCK_ROWS, _blocked

E4M3_MAX_BIT = 7  # x / s < 2^8 (e4m3's largest finite is 448): s = 2^(floor(log2(amax)) - 7)


def transposed_groups(words: torch.Tensor) -> torch.Tensor:
    """[..., W] words, W % 16 == 0 -> each 16 words (4 groups of 4) with word b of group G at 4 b + G."""
    return words.unflatten(-1, (-1, 4, 4)).transpose(-1, -2).flatten(-3)


def prepare_weights(packed: torch.Tensor, scales: torch.Tensor, matrix: str,
                    width: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MXFP4 weights (packed uint8 [E, rows, n // 2], e8m0 scales [E, rows, n // 32]; n the reduction
    width) -> what the FP8 kernels read (`gate_up_kernel` for W_gate;W_up, decode_fp8_down_gluon for W_down),
    once per weight load (the same bytes as mxfp4_tile_triton.prepare, in place of it): int32 e4m3-layout words
    [E, rows, n // 8] (groups transposed, `transposed_groups`) and uint8 multiplier fields [E, rows, n // 32]
    (`e4m3_multipliers`), in 32-row x 128-column blocks. `matrix` and `width` name the weights and their
    reduction width (e.g. "W_down", "F") in the errors."""
    n = 2 * packed.shape[-1]
    require(n % 128 == 0, f"fp8 {matrix} needs {width} % 128 == 0, got {width} = {n}")
    require(packed.shape[-2] % BLOCK_ROWS == 0,
            f"fp8 {matrix} needs a multiple of {BLOCK_ROWS} rows, got {packed.shape[-2]}")
    return _blocked(transposed_groups(device_words_e4m3(packed)), 16), _blocked(e4m3_multipliers(scales), 4)


def mma_k_columns(width: int) -> torch.Tensor:
    """Source column of each of `width` activation columns in the MMA's K order (see the module docstring);
    width a multiple of 32 (whole MXFP4 groups: a partial group would map columns past the end)."""
    require(width >= 0 and width % 32 == 0, f"the MMA's K order needs a width that is a multiple of 32, got {width}")
    k = torch.arange(width)
    h, t, i = (k % 32) // 16, (k % 16) // 4, k % 4
    return k - k % 32 + 8 * t + 4 * h + i


def split_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU reference of `split_activations`: x [T, l] -> (e4m3 [T, 2, l] hi / lo in the MMA's K order, float32
    [T] s) with x ~ s (hi + lo)."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(2.0**-118)
    s = torch.ldexp(torch.ones_like(amax), torch.frexp(amax)[1] - 1 - E4M3_MAX_BIT)
    y = (xf / s[:, None])[:, mma_k_columns(x.shape[1])]
    hi = y.to(torch.float8_e4m3fn)
    lo = (y - hi.float()).to(torch.float8_e4m3fn)
    s = torch.where(torch.isfinite(amax), s, torch.nan)
    return torch.stack([hi, lo], 1), s


if triton is not None:
    _MAX_BIT = tl.constexpr(E4M3_MAX_BIT)

    def _e4m3_grid(y):
        """y (|y| < 448) rounded to nearest-even on e4m3's grid, in float32 (2^(e - 3) from 2^-6 up, 2^-9 below): the
        residual is taken from it, not from the fp8 value read back (that form, in Triton 3.6 on the H200, gave
        wrong residuals for ~12 % of the elements, session 11; not traced further). Jitted for Triton and for
        Gluon (the interpreter cannot call a Triton function from a Gluon one)."""
        e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent, from 2^-6
        magic = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(e - 127 + 20)
        return (y + magic) - magic

    _round_to_e4m3 = triton.jit(_e4m3_grid)

    @triton.jit
    def _split_kernel(x, xq, xs, L: tl.constexpr):
        """One token row a program: amax, s = 2^(floor(log2 amax) - 7), hi = e4m3(x / s), lo = e4m3(x / s - hi),
        columns gathered into the MMA's K order."""
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, L)
        src = k - k % 32 + 8 * ((k % 16) // 4) + 4 * ((k % 32) // 16) + k % 4
        v = tl.load(x + t * L + src).to(tl.float32)
        amax = tl.max(tl.abs(v), 0)
        e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 9)  # biased exponent (>= 2^-118)
        s = ((e - _MAX_BIT) << 23).to(tl.float32, bitcast=True)
        y = v * ((254 - e + _MAX_BIT) << 23).to(tl.float32, bitcast=True)  # x / s, exact
        hi = _round_to_e4m3(y)
        tl.store(xq + t * 2 * L + k, hi.to(tl.float8e4nv))  # exact
        tl.store(xq + t * 2 * L + L + k, (y - hi).to(tl.float8e4nv))
        tl.store(xs + t, tl.where(e == 255, float("nan"), s))


def split_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, l] -> (e4m3 [T, 2, l], float32 [T]) as `split_activations_reference`."""
    T, L = x.shape
    require(L == next_pow2(L) and L % 128 == 0, f"fp8 activations need l a power of two >= 128, got {L}")
    xq = torch.empty(T, 2, L, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(T, dtype=torch.float32, device=x.device)
    _split_kernel[(T,)](x, xq, xs, L=L, num_warps=4)
    return xq, xs
