"""Weight quantisation formats (MXFP4 for MoE experts, §4.1.4)."""

from k3core.quant.mxfp4 import BLOCK, dequantize, fake_quant, quantize

__all__ = ["BLOCK", "dequantize", "fake_quant", "quantize"]
