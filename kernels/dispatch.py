"""One entry point per kernel: CUDA tensors go to Triton, anything else to the plain-torch reference.

Set K3_KERNELS_REFERENCE=1 to force the references everywhere (debugging, bisecting a numerical issue).
CPU tensors always take the reference, also under TRITON_INTERPRET=1 (the tests call the Triton
launchers directly to run them interpreted).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib import import_module
from importlib.util import find_spec
from typing import Any

import torch

# Looked up, not imported: importing triton here would fix its interpreter mode for the whole process
# before a test session had the chance to set TRITON_INTERPRET (see tests/kernels/conftest.py).
HAS_TRITON = find_spec("triton") is not None

FORCE_REFERENCE_ENV = "K3_KERNELS_REFERENCE"


def use_triton(*tensors: torch.Tensor) -> bool:
    if os.environ.get(FORCE_REFERENCE_ENV, "0") == "1":
        return False
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def _dispatcher(naive_module: str, triton_module: str, name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        module = triton_module if use_triton(first) else naive_module
        return getattr(import_module(module), name)(*args, **kwargs)

    run.__name__ = name
    run.__doc__ = f"{name}: {triton_module} on CUDA tensors, {naive_module} otherwise."
    return run


fused_kda_recurrent = _dispatcher("kernels.kda.naive", "kernels.kda.decode_triton", "fused_kda_recurrent")
kda_decode_step = _dispatcher("kernels.kda.naive", "kernels.kda.decode_step_triton", "kda_decode_step")
kda_prefill_block = _dispatcher("kernels.kda.naive", "kernels.kda.prefill_triton", "kda_prefill_block")
mla_decode_paged = _dispatcher("kernels.mla.naive", "kernels.mla.decode_triton", "mla_decode_paged")
attnres_merge_norm = _dispatcher("kernels.attnres.naive", "kernels.attnres.merge_norm_triton", "attnres_merge_norm")
attnres_inter = _dispatcher("kernels.attnres.naive", "kernels.attnres.inter_triton", "attnres_inter")
attnres_block_logits = _dispatcher("kernels.attnres.naive", "kernels.attnres.block_logits_triton",
                                   "attnres_block_logits")
situ_glu_fused = _dispatcher("kernels.moe.naive", "kernels.moe.situ_glu_triton", "situ_glu_fused")
latent_moe_decode = _dispatcher("kernels.moe.naive", "kernels.moe.latent_moe_decode_triton", "latent_moe_decode")
moe_route = _dispatcher("kernels.fused.naive", "kernels.fused.moe_router_triton", "moe_route")
expert_gate_up_glu = _dispatcher("kernels.fused.naive", "kernels.fused.expert_gemm_triton", "expert_gate_up_glu")
expert_down = _dispatcher("kernels.fused.naive", "kernels.fused.expert_gemm_triton", "expert_down")
routed_expert_gate_up_glu = _dispatcher("kernels.fused.naive", "kernels.fused.routed_expert_gemm_triton",
                                        "routed_expert_gate_up_glu")
routed_expert_down = _dispatcher("kernels.fused.naive", "kernels.fused.routed_expert_gemm_triton",
                                 "routed_expert_down")
moe_combine = _dispatcher("kernels.fused.naive", "kernels.fused.moe_combine_triton", "moe_combine")
moe_align = _dispatcher("kernels.fused.naive", "kernels.fused.moe_align_triton", "moe_align")
mla_latent_write = _dispatcher("kernels.fused.naive", "kernels.fused.mla_latent_write_triton", "mla_latent_write")
rms_norm_rows = _dispatcher("kernels.fused.naive", "kernels.fused.rms_norm_rows_triton", "rms_norm_rows")
gated_heads = _dispatcher("kernels.fused.naive", "kernels.fused.gated_heads_triton", "gated_heads")
skinny_linear = _dispatcher("kernels.fused.naive", "kernels.fused.skinny_gemm_triton", "skinny_linear")
greedy_argmax = _dispatcher("kernels.fused.naive", "kernels.fused.greedy_argmax_triton", "greedy_argmax")
lookahead_prologue = _dispatcher("kernels.fused.naive", "kernels.fused.lookahead_prologue_triton",
                                 "lookahead_prologue")


def kda_verify_replay(*args: Any, **kwargs: Any) -> Any:
    """kernels.kda.verify_triton.kda_verify_replay on the Triton recurrence for CUDA, the reference else."""
    from kernels.kda import naive, verify_triton

    on_gpu = use_triton(next(a for a in args if isinstance(a, torch.Tensor)))
    recurrent = verify_triton.fused_kda_recurrent if on_gpu else naive.fused_kda_recurrent
    return verify_triton.kda_verify_replay(*args, recurrent=recurrent, **kwargs)
