"""KDA decode step and replay verify on the H200: ours vs the fla-core 0.6.0 composition (GPU only)."""

from __future__ import annotations

from functools import partial

import torch

from kernels.kda import decode_step_triton, decode_triton, naive
from kernels.perf.harness import Row, max_err, time_ms

H, D, W = 32, 128, 4
BF16 = torch.bfloat16


def _params(dev: str):
    conv_w = (torch.randn(3, H * D, W, device=dev) * 0.5).to(BF16)
    return conv_w, torch.randn(H, device=dev) * 0.3, torch.randn(H * D, device=dev), torch.rand(D, device=dev) + 0.5


def _tokens(batch: int, length: int, dev: str):
    q, k, v, z, gate = (torch.randn(batch, length, H, D, device=dev, dtype=BF16) for _ in range(5))
    return q, k, v, z, torch.randn(batch, length, H, device=dev, dtype=BF16), gate


def _pools(slots: int, dev: str):
    return (torch.randn(slots, H, D, D, device=dev) * 0.05,
            torch.randn(slots, 3, H, D, W - 1, device=dev, dtype=BF16))


def decode_bytes(batch: int) -> float:
    state = 2 * batch * H * D * D * 4
    conv = 2 * batch * 3 * H * D * (W - 1) * 2
    io = (6 * batch * H * D + batch * H) * 2  # q, k, v, z, gate in; y out; beta
    return state + conv + io


def _fla_decode(params, x, pool, conv_dense, slots):
    """The same step composed from fla-core ops: 3x causal_conv1d_update, fused_recurrent_kda, rms_norm_gated."""
    from fla.modules.causal_conv1d import causal_conv1d_update
    from fla.modules.fused_norm_gate import rms_norm_gated
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    conv_w, A_log, dt_bias, norm_w = params
    q, k, v, z, beta, gate = x
    B = q.shape[0]
    qkv = [causal_conv1d_update(t.reshape(B, H * D), conv_dense[c], weight=conv_w[c], activation="silu")[0]
           for c, t in enumerate((q, k, v))]
    o, _ = fused_recurrent_kda_fwd(
        *(t.reshape(B, 1, H, D) for t in qkv), g=z.reshape(B, 1, H, D), beta=beta.reshape(B, 1, H),
        A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
    )
    return rms_norm_gated(o.reshape(B * H, D), gate.reshape(B * H, D), norm_w, None, activation="sigmoid")


# (tile_v, num_warps, stages, streaming cache hints) of the value-tile kernel (decode_step_triton.py).
# Measured: smaller tiles lose (B=64: 65 % at 32, 61 % at 64, 53 % at 16 columns; 8 warps 33-46 %).
DECODE_VARIANTS = ((128, 4, 1, False), (128, 4, 1, True), (128, 8, 1, False), (32, 4, 3, False))


def _full_state_step(x, params, pool, conv, slots):
    """v1: the whole [K, V] state per program (the recurrent kernel that verify still uses)."""
    y = decode_triton.fused_kda_recurrent(*(t.unsqueeze(1) for t in x), *params, pool, conv, slots)
    return y.squeeze(1)


def _step_errors(step, x, params, pool, conv, slots, check_n: int) -> dict:
    """Max abs errors of one `step(pool, conv)` from copies of the pools against the reference step."""
    ref_pools = (pool.clone(), conv.clone())
    y_ref = naive.kda_decode_step(*(t[:check_n] for t in x), *params, *ref_pools, slots[:check_n])
    p, c = pool.clone(), conv.clone()
    y = step(p, c)
    sel = slots[:check_n].long()
    return {"y_max_abs": max_err(y[:check_n], y_ref), "state_max_abs": max_err(p[sel], ref_pools[0][sel]),
            "conv_max_abs": max_err(c[sel], ref_pools[1][sel])}


def decode_rows(batches: tuple[int, ...] = (1, 64, 256),
                variants: tuple[tuple[int, int, int, bool], ...] = DECODE_VARIANTS) -> list[Row]:
    rows: list[Row] = []
    params = _params("cuda")
    for B in batches:
        x = [t[:, 0] for t in _tokens(B, 1, "cuda")]
        slots = torch.randperm(2 * B, device="cuda")[:B].int()
        pool, conv = _pools(2 * B, "cuda")
        check_n = min(B, 16)  # the reference loops over sequences in Python; 16 of them suffice
        shape = f"B={B},H={H},K=V={D}"
        full = partial(_full_state_step, x, params)
        err = _step_errors(partial(full, slots=slots), x, params, pool, conv, slots, check_n)
        ms, how = time_ms(partial(full, pool, conv, slots))
        rows.append(Row("kda_decode_step", shape, "ours v1 (full state per program, w=4)", ms, decode_bytes(B),
                        note=how, extra=err))
        for tv, nw, st, streaming in variants:
            tuning = (-5.0, None, 1e-6, 1e-6, tv, nw, st, streaming)
            tiled = partial(decode_step_triton.kda_decode_tiled, *x, *params)
            try:
                err = _step_errors(lambda p, c, f=tiled, s=slots, t=tuning: f(p, c, s, *t), x, params, pool, conv,
                                   slots, check_n)
                ms, how = time_ms(partial(tiled, pool, conv, slots, *tuning))
            except Exception as e:  # noqa: BLE001 - a variant that does not build must not hide the others
                ms, how, err = float("nan"), repr(e)[:200], {}
            label = f"ours(tile_v={tv},w={nw},stages={st}{',streaming' if streaming else ''})"
            rows.append(Row("kda_decode_step", shape, label, ms, decode_bytes(B),
                            note=how, extra=err))
        try:
            conv_dense = [torch.randn(B, H * D, W, device="cuda", dtype=BF16) for _ in range(3)]
            ms, how = time_ms(partial(_fla_decode, params, x, pool, conv_dense, slots))
            rows.append(Row("kda_decode_step", shape, "fla-core composition", ms, decode_bytes(B), note=how))
        except Exception as e:  # noqa: BLE001 - report, do not abort the whole benchmark
            rows.append(Row("kda_decode_step", shape, "fla-core composition", float("nan"), note=repr(e)[:200]))
    return rows


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
