"""KDA decode step on the H200: ours vs the fla-core 0.6.0 composition (GPU only). The replay verify's
cases: kda_verify_cases.py.

Also the decode step on the serving pool's head-interleaved pages (`k3core/cache/pool_views.py`): one
strided launch over all heads against the per-head launches the fast path ran before, same buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from k3core.cache.layout import PoolLayout, plan_layout, shape_from_config
from k3core.cache.pool_views import PoolViews
from k3core.presets import preset
from kernels.kda import decode_step_triton, decode_triton, naive
from kernels.perf.harness import Row, max_err, time_ms

H, D, W = 32, 128, 4
BF16 = torch.bfloat16


def _params(dev: str, heads: int = H, dim: int = D, dtype: torch.dtype = BF16):
    conv_w = (torch.randn(3, heads * dim, W, device=dev) * 0.5).to(dtype)
    return (conv_w, torch.randn(heads, device=dev) * 0.3, torch.randn(heads * dim, device=dev),
            torch.rand(dim, device=dev) + 0.5)


def _tokens(batch: int, length: int, dev: str):
    q, k, v, z, gate = (torch.randn(batch, length, H, D, device=dev, dtype=BF16) for _ in range(5))
    return q, k, v, z, torch.randn(batch, length, H, device=dev, dtype=BF16), gate


def _pools(slots: int, dev: str):
    return (torch.randn(slots, H, D, D, device=dev) * 0.05,
            torch.randn(slots, 3, H, D, W - 1, device=dev, dtype=BF16))


def decode_bytes(batch: int, heads: int = H, dim: int = D) -> float:
    state = 2 * batch * heads * dim * dim * 4
    conv = 2 * batch * 3 * heads * dim * (W - 1) * 2
    io = (6 * batch * heads * dim + batch * heads) * 2  # q, k, v, z, gate in; y out; beta
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


@dataclass(frozen=True)
class DecodeVariant:
    """One build of the decode-step kernel (decode_step_triton.py): block_v value columns per program (128:
    the whole state; fewer: D // block_v programs per head, the last to arrive normalises), warps, the cache
    hints on the state's load (evict_first) and store (.cs) (None: the launcher's rule by size), the grid
    order (heads first: (H, B)), and the state's loads after the inputs' (pinned there by a barrier; off:
    where ptxas puts them, the order before session 9)."""

    warps: int = 4
    block_v: int = 128
    evict_first: bool | None = None
    stream_store: bool | None = None
    heads_first: bool = True
    state_after_inputs: bool = True

    @property
    def label(self) -> str:
        flags = (("evict_first", self.evict_first), (".cs", self.stream_store), ("heads first", self.heads_first),
                 ("state after inputs", self.state_after_inputs))
        hints = ",".join(h for h, on in flags if on)
        if self.evict_first is None and self.stream_store is None:
            hints = "hints by size" + ("," + hints if hints else "")
        return f"ours(block_v={self.block_v},w={self.warps}{',' + hints if hints else ''})"

    def launch(self, x, params, pool, conv, slots) -> torch.Tensor:
        hinted = x[0].shape[0] * x[0].shape[1] < decode_step_triton.DECODE_UNHINTED_TILES  # the launcher's rule
        return decode_step_triton.kda_decode_split(
            *x, *params, pool, conv, slots, -5.0, None, 1e-6, 1e-6, self.block_v, self.warps,
            hinted if self.evict_first is None else self.evict_first,
            hinted if self.stream_store is None else self.stream_store, self.heads_first, self.state_after_inputs)


# Measured and dropped from the sweep (docs/kernels.md history 14 and 36; B=64 / 256 at H=32, % copy): value
# splits 64 / 32 / 16 (4 and 8 warps) 41-72 / 39-71, 8 warps 43 / 42, persistent programs (2 per SM, next slot
# prefetched) 81 / 78, with Triton-staged states (2-3 stages in shared memory) 34-54 / 35-56; the two hints
# apart; the state's loads pinned before the inputs' 85.6 / 87.4 (hints) and 82.5 / 91.8 (none), 2 or 4 column
# tiles per program (all loads first) 79.8 / 78.3 and 69.2 / 65.4, sequences first 83.4 / 84.2, a register cap
# of 168 (three programs per SM, 120-264 B of spills) 74.7 / 71.1 and 81.4 / 80.5 with the state after the
# inputs. Each shape's control is the launcher's default (`launcher_step`), timed in the same process; the
# variant is the order before session 9.
DECODE_VARIANTS = (DecodeVariant(state_after_inputs=False),)


def launcher_step(x, params, pool, conv, slots) -> torch.Tensor:
    """The step as the serving path launches it (decode_step_triton.kda_decode_step's defaults)."""
    return decode_step_triton.kda_decode_step(*x, *params, pool, conv, slots)


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


def _timed_row(kernel: str, shape: str, label: str, nbytes: float, errors: Callable[[], dict],
               call: Callable[[], object]) -> Row:
    """One row: the check (`errors`, a dict into extra), then the time of `call`; a build or run failure
    becomes the row's note (NaN time) instead of hiding the other rows."""
    try:
        err = errors()
        ms, how = time_ms(call)
    except Exception as e:  # noqa: BLE001 - a variant that does not build must not hide the others
        ms, how, err = float("nan"), repr(e)[:200], {}
    return Row(kernel, shape, label, ms, nbytes, note=how, extra=err)


def decode_rows(batches: tuple[int, ...] = (1, 64, 256), variants: tuple[DecodeVariant, ...] = DECODE_VARIANTS,
                peers: bool = True, pool_batches: tuple[int, ...] = (16, 64, 256)) -> list[Row]:
    """The step at H=32 per batch: the launcher's default, then each variant; with `peers` also v1 and the
    fla-core composition. Then the same on the serving pool's view (`pool_view_rows`)."""
    rows: list[Row] = []
    params = _params("cuda")
    for B in batches:
        x = [t[:, 0] for t in _tokens(B, 1, "cuda")]
        slots = torch.randperm(2 * B, device="cuda")[:B].int()
        pool, conv = _pools(2 * B, "cuda")
        check_n = min(B, 16)  # the reference loops over sequences in Python; 16 of them suffice
        shape = f"B={B},H={H},K=V={D}"
        steps = {"ours: launcher default": launcher_step, **{v.label: v.launch for v in variants}}
        if peers:
            steps = {"ours v1 (full state per program, w=4)": _full_state_step, **steps}
        for label, step in steps.items():
            errors = partial(_step_errors, partial(step, x, params, slots=slots), x, params, pool, conv, slots,
                             check_n)
            rows.append(_timed_row("kda_decode_step", shape, label, decode_bytes(B), errors,
                                   partial(step, x, params, pool, conv, slots)))
        if not peers:
            continue
        try:
            conv_dense = [torch.randn(B, H * D, W, device="cuda", dtype=BF16) for _ in range(3)]
            ms, how = time_ms(partial(_fla_decode, params, x, pool, conv_dense, slots))
            rows.append(Row("kda_decode_step", shape, "fla-core composition", ms, decode_bytes(B), note=how))
        except Exception as e:  # noqa: BLE001 - report, do not abort the whole benchmark
            rows.append(Row("kda_decode_step", shape, "fla-core composition", float("nan"), note=repr(e)[:200]))
    try:
        rows += pool_view_rows(pool_batches, variants=variants)
    except Exception as e:  # noqa: BLE001 - the rows above stay
        rows.append(Row("kda_decode_pool_view", "mini pool view", "ours: one strided launch, all heads",
                        float("nan"), note=repr(e)[:200]))
    return rows


@dataclass
class PoolViewCase:
    """One KDA layer's decode step on a page buffer laid out as the serving pool (`plan_layout` of a preset,
    state fp32, conv and MLA in `dtype`), inputs as the fast path passes them: row-strided column slices of
    one projection output."""

    layout: PoolLayout
    layer: int  # the KDA layer whose slot the views address (the last slot of a group: a non-zero offset)
    data: torch.Tensor  # [pages, page_bytes] uint8
    x: tuple[torch.Tensor, ...]  # q, k, v, z, beta, gate
    params: tuple[torch.Tensor, ...]
    head_params: list[tuple[torch.Tensor, ...]]  # per head, contiguous (prepared once, as the old fast path)
    slots: torch.Tensor

    def views(self, data: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([pages, H, D, D] state, [pages, 3, H, D, W-1] conv) of `data` (default: the case's buffer)."""
        views = PoolViews(self.data if data is None else data, self.layout)
        return views.kda_state(self.layer), views.kda_conv(self.layer)


def pool_view_case(model: str, batch: int, device: str, dtype: torch.dtype = BF16) -> PoolViewCase:
    layout = plan_layout(shape_from_config(preset(model), model), state_dtype=torch.float32, conv_dtype=dtype,
                         mla_dtype=dtype)
    heads, dim = layout.heads_per_rank, layout.shape.kda_head_dim
    data = torch.randint(0, 256, (2 * batch, layout.page_bytes), dtype=torch.uint8, device=device)
    case_layer = layout.layers_per_group - 1
    wide = torch.randn(batch, 5 * heads * dim + heads + 8, device=device, dtype=dtype)  # + 8: like a fused GEMM
    q, k, v, z, gate = (wide[:, i * heads * dim : (i + 1) * heads * dim].view(batch, heads, dim) for i in range(5))
    beta = wide[:, 5 * heads * dim : 5 * heads * dim + heads]
    params = _params(device, heads, dim, dtype)
    conv_w, a_log, dt_bias, norm_w = params
    head_params = [(conv_w[:, h * dim : (h + 1) * dim].contiguous(), a_log[h : h + 1].clone(),
                    dt_bias[h * dim : (h + 1) * dim].clone(), norm_w) for h in range(heads)]
    slots = torch.randperm(2 * batch, device=device)[:batch].int()
    case = PoolViewCase(layout, case_layer, data, (q, k, v, z, beta, gate), params, head_params, slots)
    state, conv = case.views()
    state.copy_(torch.randn(state.shape, device=device) * 0.05)  # the other bytes stay random
    conv.copy_(torch.randn(conv.shape, device=device))
    return case


def strided_step(case: PoolViewCase, state: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """The fast path's form: one launch over all heads on the strided pool views."""
    return decode_step_triton.kda_decode_step(*case.x, *case.params, state, conv, case.slots)


def per_head_step(case: PoolViewCase, state: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """The former form: one launch per head on [pages, 1, D, D] views of the same buffer, outputs concatenated."""
    outs = [decode_step_triton.kda_decode_step(*(t[:, h : h + 1] for t in case.x), *hp, state[:, h : h + 1],
                                               conv[:, :, h : h + 1], case.slots)
            for h, hp in enumerate(case.head_params)]
    return torch.cat(outs, dim=1)


def pool_view_errors(case: PoolViewCase, check_n: int,
                     step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict:
    """One strided launch (`step(state, conv)`, default `strided_step`) against (a) the reference on dense copies of the first `check_n` addressed states
    and (b) the per-head launches on a copy of the buffer; `outside_unchanged`: no byte of the buffer that
    the addressed slots' views do not cover was written. The case's buffer is left as it was."""
    before = case.data.clone()
    state, conv = case.views()
    y = strided_step(case, state, conv) if step is None else step(state, conv)
    ref_state, ref_conv = (t[case.slots[:check_n].long()].clone() for t in case.views(before))
    y_ref = naive.kda_decode_step(*(t[:check_n] for t in case.x), *case.params, ref_state, ref_conv,
                                  torch.arange(check_n, device=y.device))
    sel = case.slots[:check_n].long()
    result = {"y_max_abs": max_err(y[:check_n], y_ref), "state_max_abs": max_err(state[sel], ref_state),
              "conv_max_abs": max_err(conv[sel], ref_conv)}
    heads_data = before.clone()
    head_state, head_conv = case.views(heads_data)
    y_heads = per_head_step(case, head_state, head_conv)
    result["per_head_y_max_abs"] = max_err(y, y_heads)
    result["per_head_state_max_abs"] = max_err(state, head_state)
    result["per_head_conv_max_abs"] = max_err(conv, head_conv)
    restored = case.data.clone()
    restored_state, restored_conv = case.views(restored)
    before_state, before_conv = case.views(before)
    all_slots = case.slots.long()
    restored_state[all_slots], restored_conv[all_slots] = before_state[all_slots], before_conv[all_slots]
    result["outside_unchanged"] = bool(torch.equal(restored, before))
    case.data.copy_(before)
    return result


def pool_view_rows(batches: tuple[int, ...] = (16, 64, 256), model: str = "mini",
                   variants: tuple[DecodeVariant, ...] = DECODE_VARIANTS) -> list[Row]:
    """Decode step on the serving pool's pages: one strided launch (the launcher's default, then each
    variant) vs per-head launches, same buffer."""
    rows: list[Row] = []
    for B in batches:
        case = pool_view_case(model, B, "cuda")
        heads, dim = case.layout.heads_per_rank, case.layout.shape.kda_head_dim
        shape = f"B={B},H={heads},K=V={dim},{model} pool view"
        nbytes = decode_bytes(B, heads, dim)
        state, conv = case.views()
        steps = {"ours: one strided launch, all heads": partial(strided_step, case),
                 **{v.label: partial(v.launch, case.x, case.params, slots=case.slots) for v in variants}}
        for label, step in steps.items():
            rows.append(_timed_row("kda_decode_pool_view", shape, label, nbytes,
                                   partial(pool_view_errors, case, min(B, 16), step), partial(step, state, conv)))
        ms, how = time_ms(partial(per_head_step, case, state, conv))
        rows.append(Row("kda_decode_pool_view", shape, f"baseline: {heads} per-head launches + concat", ms, nbytes,
                        note=how))
    return rows
