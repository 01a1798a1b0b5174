"""Helpers shared by the FP8 MoE decode tests (test_moe_fp8.py, test_moe_fp8_down.py): float64 views of the
e4m3 weight layout as the kernels' registers hold it, written from the layout's documented bit placement."""

from __future__ import annotations

import torch

from k3core.quant import mxfp4_device
from kernels.moe.mxfp4_tile_triton import BLOCK_ROWS

F64 = torch.float64


def e4m3_values(bytes_: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bytes -> their float64 values."""
    return bytes_.view(torch.float8_e4m3fn).to(F64)


def unblocked(t: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of mxfp4_tile_triton._blocked: blocks of BLOCK_ROWS x cols back to row-major [..., R, C]."""
    *lead, rows, width = t.shape
    b = t.reshape(*lead, rows // BLOCK_ROWS, width // cols, BLOCK_ROWS, cols).transpose(-3, -2)
    return b.reshape(t.shape)


def weights_in_mma_k_order(words: torch.Tensor, mults: torch.Tensor) -> torch.Tensor:
    """What the kernel's A fragments hold, times their multipliers, as float64 [E, R, l] in the MMA's K order:
    a step's stored word at position 4 t + G (row-major after unblocking) feeds group G's MMA from lane t,
    its register h byte i at k = 16 h + 4 t + i of the group."""
    words, mults = unblocked(words, 16), unblocked(mults, 4)
    E, R, W = words.shape
    codes = mxfp4_device.decode_e4m3(words).reshape(E, R, W // 16, 4, 4, 2, 4)  # [step, t, G, h, i]
    values = e4m3_values(codes).permute(0, 1, 2, 4, 5, 3, 6)  # [step, G, h, t, i]
    mult = (mults.to(torch.int32) << 23).view(torch.float32).to(F64).reshape(E, R, W // 16, 4)
    return (values * mult[..., None, None, None]).reshape(E, R, W * 8)
