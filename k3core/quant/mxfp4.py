"""OCP Microscaling MXFP4: e2m1 elements sharing one e8m0 scale per block of 32.

Layout (the compressed-tensors ``mxfp4-pack-quantized`` convention):
- blocks run along the LAST dim (``in_features`` of a Linear weight), 32 elements each;
- ``packed``: uint8 ``[..., K // 2]``, two e2m1 codes per byte, element ``2i`` in the LOW nibble and
  element ``2i + 1`` in the HIGH nibble;
- ``scales``: uint8 ``[..., K // 32]``, e8m0 biased exponents: byte ``e`` means ``2 ** (e - 127)``;
  ``0xFF`` is NaN (a block that held a NaN or an infinity dequantises to NaN).

An e2m1 code is ``sign << 3 | magnitude_index`` with magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6``.
Scale choice follows OCP MX v1.0 §6.3: shared exponent ``floor(log2(amax)) - 2`` (2 = emax of e2m1),
elements rounded to nearest, ties to even, then saturated to ±6.
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1_MAX = 6.0
E2M1_EMAX = 2
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Magnitudes indexed by the 3 low bits of a code; the 4th bit is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_blocks(k: int, group: int) -> None:
    if group != BLOCK:
        raise ValueError(f"MXFP4 blocks are {BLOCK} elements (OCP MX); got group={group}")
    if k % group:
        raise ValueError(f"last dim {k} is not a multiple of the MXFP4 block size {group}")


def _shared_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Unbiased shared exponent per block of float32 ``[..., K // 32, 32]`` (int32), clamped to e8m0's range."""
    amax = blocks.abs().amax(dim=-1)
    # frexp gives amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) == e - 1 exactly, no log rounding.
    _, e = torch.frexp(amax)
    exp = (e - 1 - E2M1_EMAX).to(torch.int32)
    exp = torch.where(amax == 0, torch.full_like(exp, -E8M0_BIAS), exp)
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def _round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Magnitude index (uint8) of |y| rounded to the nearest e2m1 magnitude, ties to even, saturating.

    Within each binade the e2m1 grid is uniform (step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]) and the
    parity of the multiple of the step is the parity of the code, so torch.round (half to even) on
    |y| / step is exactly round-to-nearest-even on the grid.
    """
    mags = torch.nan_to_num(y.abs(), nan=0.0).clamp(max=E2M1_MAX)
    step = torch.where(mags < 2, 0.5, torch.where(mags < 4, 1.0, 2.0))
    q = torch.round(mags / step) * step
    code = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4))
    return code.to(torch.uint8)


def quantize(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` (any float dtype, last dim a multiple of 32) to ``(packed uint8, scales uint8)``."""
    _check_blocks(w.shape[-1], group)
    x = w.float().unflatten(-1, (-1, group))
    exp = _shared_exponents(x)
    # Scaling by a power of two is exact (ldexp), so the only rounding is the e2m1 one.
    y = torch.ldexp(x, (-exp).unsqueeze(-1).to(x.dtype))
    # A NaN element gets code 0; its block's scale becomes NaN below, so it decodes to NaN anyway.
    codes = (_round_to_e2m1(y) | (torch.signbit(y).to(torch.uint8) << 3)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp + E8M0_BIAS).to(torch.uint8)
    non_finite = ~torch.isfinite(x).all(dim=-1)
    scales = torch.where(non_finite, torch.full_like(scales, E8M0_NAN), scales)
    return packed, scales


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K // 2]`` -> e2m1 codes int64 ``[..., K]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed MXFP4 must be uint8, got {packed.dtype}")
    low = (packed & 0x0F).to(torch.int64)
    high = (packed >> 4).to(torch.int64)
    return torch.stack((low, high), dim=-1).flatten(-2)


def decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32 powers of two (0xFF -> NaN)."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 (e8m0), got {scales.dtype}")
    exp = scales.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp.to(torch.float32))
    return torch.where(scales == E8M0_NAN, torch.full_like(value, float("nan")), value)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``[..., K // 2]`` + ``[..., K // 32]`` -> ``dtype`` ``[..., K]``."""
    codes = unpack_codes(packed)
    k = codes.shape[-1]
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != k:
        raise ValueError(
            f"MXFP4 shapes disagree: packed {tuple(packed.shape)} holds {k} elements per row, "
            f"scales {tuple(scales.shape)} cover {scales.shape[-1] * BLOCK}"
        )
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    values = table[codes & 0x7]
    values = torch.where(codes >= 8, -values, values).unflatten(-1, (-1, BLOCK))
    return (values * decode_scales(scales).unsqueeze(-1)).flatten(-2).to(dtype)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        packed, scales = quantize(w)
        return dequantize(packed, scales, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Straight-through estimator: the rounding is treated as identity for the gradient (§4.1.4 QAT).
        return grad


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 quantise-dequantise in ``w``'s dtype with an identity gradient, for QAT."""
    return _FakeQuantSTE.apply(w)
