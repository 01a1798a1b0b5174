"""Speculative verify by replay (K3 report §5.4.2) on top of the fused KDA recurrent kernel.

A verify step feeds n+1 new tokens per sequence: the last sampled token t0 (always valid) and n drafts.
Only t0's state is committed. The drafts' projected inputs (q, k, v, z, beta: a few KB per token, against
the 64 KB-per-head state) are kept, and the next step first replays the a_b accepted drafts from them on
chip, then runs its own window, in one loop: no per-draft state snapshot is ever written or read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.kda.decode_triton import fused_kda_recurrent

DraftInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def kda_verify_replay(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    previous_drafts: DraftInputs | None = None, n_accepted: torch.Tensor | None = None,
    lower_bound: float | None = -5.0, recurrent: Callable[..., torch.Tensor] = fused_kda_recurrent,
    **options,
) -> tuple[torch.Tensor, DraftInputs]:
    """One verify step: new window [B, n+1, H, D] (t0 then drafts); previous_drafts [B, n', ...] with
    n_accepted [B] of them accepted by the last step. Returns (y [B, n+1, H, D], the drafts to cache).
    `recurrent` is the Triton kernel or its reference (kernels.dispatch picks by device)."""
    if (previous_drafts is None) != (n_accepted is None):
        raise ValueError("previous_drafts and n_accepted must be given together")
    replay = None if previous_drafts is None else (*previous_drafts, n_accepted)
    y = recurrent(
        q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool, slots,
        replay=replay, n_commit=1, lower_bound=lower_bound, **options,
    )
    # Views, not copies: the caller keeps these tensors alive until the next step.
    return y, (q[:, 1:], k[:, 1:], v[:, 1:], z[:, 1:], beta[:, 1:])
