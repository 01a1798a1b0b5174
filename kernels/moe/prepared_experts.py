"""MXFP4 experts in the routed-expert decoders' layouts, prepared once per weight load (read by
kernels.moe.latent_moe_decode_triton and its Gluon forms): the bf16 decoders' layout
(kernels.moe.mxfp4_tile_triton.prepare) or, opt-in, the FP8 decoders' e4m3 layout
(kernels.moe.fp8_operands_triton.prepare_weights), recorded with the tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import require
from kernels.moe import fp8_operands_triton
from kernels.moe.mxfp4_tile_triton import prepare


class PreparedExperts(NamedTuple):
    """MXFP4 experts in the decoder's layout (kernels.moe.mxfp4_tile_triton.prepare): int32 words and uint8
    multiplier fields of W_gate;W_up [E, 2F, l / 8], [E, 2F, l / 32] and of W_down [E, l, F / 8], [E, l, F / 32]
    (logical shapes), stored in 32-row blocks. `gate_up_fp8`: W_gate;W_up's words and fields are in
    decode_fp8_gluon's e4m3 layout instead (same shapes and dtypes, other bits): recorded here because nothing in
    the tensors tells the two apart, and a kernel reading one as the other computes garbage. `down_fp8`: W_down's
    too (with gate_up_fp8: the FP8 down reads the FP8 gate/up's e4m3 h, kernels.moe.decode_fp8_down_gluon)."""

    gate_up_words: torch.Tensor
    gate_up_mults: torch.Tensor
    down_words: torch.Tensor
    down_mults: torch.Tensor
    gate_up_fp8: bool = False
    down_fp8: bool = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four prepared tensors (gate/up words, multipliers, down words, multipliers)."""
        return self.gate_up_words, self.gate_up_mults, self.down_words, self.down_mults


def prepare_experts(gate_up_packed: torch.Tensor, gate_up_scales: torch.Tensor, down_packed: torch.Tensor,
                    down_scales: torch.Tensor, gate_up_fp8: bool = False, down_fp8: bool = False) -> PreparedExperts:
    """Canonical packs -> PreparedExperts, once per weight load (the same number of bytes). `gate_up_fp8`: W_gate;W_up
    in decode_fp8_gluon's e4m3 layout instead, a load-time choice: such experts serve only the calls the FP8 gate/up
    serves (`decode_fp8_gluon.serves`: CUDA, bf16 x, at most 16 tokens); faster at T = 2 and 16, alike at T = 1
    and 4 (docs/kernels.md history 47, 49). `down_fp8` (opt-in, with gate_up_fp8): W_down in that layout too, for the
    FP8 down (docs/kernels.md history 50)."""
    require(gate_up_packed.dtype == torch.uint8 and down_packed.dtype == torch.uint8, "packed weights are uint8")
    require(gate_up_fp8 or not down_fp8, "down_fp8 needs gate_up_fp8 (the FP8 down reads the FP8 gate/up's e4m3 h)")
    gate_up = (fp8_operands_triton.prepare_weights(gate_up_packed, gate_up_scales, "W_gate;W_up", "l") if gate_up_fp8
               else prepare(gate_up_packed, gate_up_scales))
    down = (fp8_operands_triton.prepare_weights(down_packed, down_scales, "W_down", "F") if down_fp8
            else prepare(down_packed, down_scales))
    return PreparedExperts(*gate_up, *down, gate_up_fp8=gate_up_fp8, down_fp8=down_fp8)
