"""The KDA layer's prefill through the fused Triton block (kernels.dispatch.kda_prefill_block) on CUDA.

The block takes the projections before the short conv and returns the gated, normalised output (before
o_proj) with the final recurrent and conv states, so the layer's torch conv / L2Norm / gate / delta rule /
gated norm become one launcher call. The BatchCache's layouts are the kernel's ([B, 3, H, D, W-1] conv,
[B, H, D, D] recurrent), so the mapping is only dtype: the kernel reads either state in any dtype and
returns the recurrent state in float32 and the conv windows in the activations' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import dispatch

if TYPE_CHECKING:
    from k3core.layers.batch import BatchLayout
    from k3core.layers.kda import KimiDeltaAttention


# What the block was checked against on the H200: bench.kernels' four shapes against float64 (bf16, D=128), and
# `nano` (D=32) in float32 against the CPU torch path (tests/k3core/test_model_gpu.py, session 5, after the
# TF32 fix in kernels/kda/prefill_triton.py dot_precision). float16 is left out until a device run checks it
# (it overflowed in the UT pass until d09f0df).
VALIDATED_HEAD_DIMS = (32, 128)
VALIDATED_DTYPES = (torch.bfloat16, torch.float32)


def triton_prefill_applies(layer: KimiDeltaAttention, x: torch.Tensor) -> bool:
    """CUDA activations in a validated dtype and head dim (above), and the bounded gate (the launcher would
    run the reference for the softplus one). Not under autograd: the kernel has no backward, so a training
    forward (the learner's) would silently leave the KDA weights without gradients."""
    return (layer.lower_bound is not None and layer.head_dim in VALIDATED_HEAD_DIMS and x.dtype in VALIDATED_DTYPES
            and not torch.is_grad_enabled() and dispatch.use_triton(x))


def kda_prefill_triton(
    layer: KimiDeltaAttention, x: torch.Tensor, layout: BatchLayout, conv_state: torch.Tensor,
    recurrent: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, hidden] packed prefill tokens -> (o [N, H*D] before o_proj, new conv state, new recurrent
    state), the states in the dtypes of the ones read from the cache."""
    heads = [layer._heads(t)[None] for t in (layer.q_proj(x), layer.k_proj(x), layer.v_proj(x))]
    z = layer._heads(layer.f_b_proj(layer.f_a_proj(x)))[None]
    beta_logits = layer.b_proj(x)[None]
    gate = layer.g_proj(x) if layer.full_rank_gate else layer.g_b_proj(layer.g_a_proj(x))
    y, new_state, new_conv = dispatch.kda_prefill_block(
        *heads, z, beta_logits, layer._heads(gate)[None], layer.stacked_conv_weight(), layer.A_log.reshape(layer.heads),
        layer.dt_bias, layer.o_norm.weight, initial_state=recurrent, initial_conv=conv_state,
        cu_seqlens=layout.cu_seqlens(),  # on the CPU: the launcher plans chunks without a device sync
        lower_bound=layer.lower_bound, scale=layer.scale, norm_eps=layer.eps,
    )
    return y[0].reshape(x.shape[0], -1), new_conv.to(conv_state.dtype), new_state.to(recurrent.dtype)
