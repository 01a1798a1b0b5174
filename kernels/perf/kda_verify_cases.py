"""KDA replay verify on the H200 (GPU only): n drafts verified by replaying the accepted ones (ours) against
one state snapshot per draft (ours with snapshots, and fla-core 0.6.0's speculative recurrence)."""

from __future__ import annotations

from functools import partial

import torch

from kernels.kda import decode_triton
from kernels.perf.harness import Row, time_ms
from kernels.perf.kda_decode_cases import D, H, _params, _pools, _tokens, decode_bytes


def _fla_spec_step(x, params, pool, indices, accepted):
    """fla's speculative recurrence: one state per draft written to indexed slots (the state-caching way)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    q, k, v, z, beta, _ = x
    _, A_log, dt_bias, _ = params
    return fused_recurrent_kda_fwd(
        q, k, v, g=z, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=True,
        ssm_state_indices=indices, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
    )


def verify_rows(batch: int = 64, drafts: tuple[int, ...] = (1, 2, 4, 8),
                variants: tuple[tuple[int, int], ...] = ((128, 4),)) -> list[Row]:
    """Verify n drafts: replay (ours) vs one state snapshot per draft (ours with snapshots, and fla's)."""
    rows: list[Row] = []
    params = _params("cuda")
    B = batch
    for n in drafts:
        x = _tokens(B, n + 1, "cuda")
        prev = _tokens(B, n, "cuda")[:5]
        accepted = torch.full((B,), n, device="cuda", dtype=torch.int32)  # worst case: replay all n
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        pool, conv = _pools(B * (n + 1), "cuda")
        shape = f"B={B},n={n}"
        snaps = torch.empty(B, n + 1, H, D, D, device="cuda")
        for bv, nw in variants:
            tuning = {"block_v": bv, "num_warps": nw}
            ms, how = time_ms(partial(decode_triton.fused_kda_recurrent, *x, *params, pool, conv, slots,
                                      replay=(*prev, accepted), n_commit=1, **tuning))
            rows.append(Row("kda_verify", shape, f"ours replay(block_v={bv},w={nw})", ms, decode_bytes(B),
                            note=how))
            ms, how = time_ms(partial(decode_triton.fused_kda_recurrent, *x, *params, pool, conv, slots,
                                      n_commit=1, snapshots=snaps, **tuning))
            rows.append(Row("kda_verify", shape, f"baseline: ours state-per-draft(block_v={bv},w={nw})", ms,
                            note=how))
        try:
            indices = torch.arange(B * (n + 1), device="cuda", dtype=torch.int32).reshape(B, n + 1)
            ms, how = time_ms(partial(_fla_spec_step, x, params, pool, indices, accepted.clamp_min(1)))
            rows.append(Row("kda_verify", shape, "fla state-per-draft (recurrence only)", ms, note=how))
        except Exception as e:  # noqa: BLE001
            rows.append(Row("kda_verify", shape, "fla state-per-draft (recurrence only)", float("nan"),
                            note=repr(e)[:200]))
    return rows
