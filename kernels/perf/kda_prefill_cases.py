"""KDA prefill block on the H200: ours vs the same block composed from fla-core 0.6.0 ops (GPU only). The
tuning variants timed, and the pick among them: kda_prefill_tuning.py.

The peer: 3x fla `causal_conv1d` (SiLU), `chunk_kda` (safe_gate, lower_bound=-5, gate, L2Norm and
sigmoid(beta) in kernel, final state out) and `rms_norm_gated` (sigmoid). Both start from no carried state
and return the final state. Accuracy: relative error of y and of the final state against a float64
evaluation of the block (k3core ops in float64) on the first <= ACC_TOKENS tokens of each sequence (at most two
sequences), for ours and for the peer.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from functools import partial

import torch

from k3core.ops.kda import causal_short_conv, kda_chunk, kda_gate_bounded, l2norm
from k3core.ops.norm import gated_rms_norm
from kernels.kda import prefill_triton
from kernels.perf.harness import Row, kernel_ms, rel_err, time_ms
from kernels.perf.kda_prefill_tuning import pick_from_files, selected_variants

D, W = 128, 4
BF16 = torch.bfloat16
ACC_TOKENS = 160  # per sequence of the accuracy case: 3 chunks (one partial); the CPU oracle is slow
# (label, batch, length, heads, packed lengths or None)
SHAPES = (
    ("B=1,T=32K,H=16", 1, 32768, 16, None),
    ("B=1,T=128K,H=16", 1, 131072, 16, None),
    ("B=8,T=4K,H=32", 8, 4096, 32, None),
    ("varlen 8 seqs (12K,8K,4K,3000,2341,1000,77,2700),H=32", 1, 0, 32,
     (12288, 8192, 4096, 3000, 2341, 1000, 77, 2700)),
)
def selected_shapes(shapes=SHAPES) -> tuple:
    """KDA_PREFILL_SHAPES (';'-separated label prefixes, e.g. 'B=1,T=32K;B=8') picks some shapes."""
    names = os.environ.get("KDA_PREFILL_SHAPES")
    return tuple(s for s in shapes if names is None or any(s[0].startswith(n) for n in names.split(";")))


def _params(heads: int, dev: str):
    """Weights as a served layer holds them: normal tensors, even when made inside inference_mode (the layer's
    stacked conv weight is one), so the launcher's tap-major copy is cached (session 7's rows still
    transposed per call: 3 us)."""
    with torch.inference_mode(False):
        conv_w = (torch.randn(3, heads * D, W, device=dev) * 0.5).to(BF16)
        return conv_w, torch.randn(heads, device=dev) * 0.3, torch.randn(heads * D, device=dev), \
            torch.rand(D, device=dev) + 0.5


def _inputs(batch: int, length: int, heads: int, dev: str):
    q, k, v, z, gate = (torch.randn(batch, length, heads, D, device=dev, dtype=BF16) for _ in range(5))
    return q, k, v, z, torch.randn(batch, length, heads, device=dev, dtype=BF16), gate


def fla_block(x, params, cu: torch.Tensor | None, cu_cpu: torch.Tensor | None):
    """The block composed from fla-core 0.6.0 ops."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import chunk_kda

    q, k, v, z, beta, gate = x
    B, T, H, _ = q.shape
    conv_w, A_log, dt_bias, norm_w = params
    seq = {"cu_seqlens": cu, "cu_seqlens_cpu": cu_cpu}
    qkv = [causal_conv1d(t.reshape(B, T, H * D), weight=conv_w[c], activation="silu", output_final_state=True,
                         **seq)[0].reshape(B, T, H, D) for c, t in enumerate((q, k, v))]
    o, state = chunk_kda(*qkv, g=z, beta=beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0, **seq)
    y = rms_norm_gated(o.reshape(-1, D), gate.reshape(-1, D), norm_w, None, activation="sigmoid")
    return y.reshape(B, T, H, D), state


def float64_block(x, params, cu: torch.Tensor | None):
    """The block in float64 from k3core ops (the oracle)."""
    q, k, v, z, beta, gate = (t.double() for t in x)
    B, T, H, _ = q.shape
    conv_w, A_log, dt_bias, norm_w = (p.double() for p in params)
    qkv = [causal_short_conv(t.reshape(B, T, H * D), conv_w[c], cu_seqlens=cu)[0].reshape(B, T, H, D)
           for c, t in enumerate((q, k, v))]
    g = kda_gate_bounded(z, A_log, -5.0, dt_bias)
    o, state = kda_chunk(l2norm(qkv[0]), l2norm(qkv[1]), qkv[2], g, torch.sigmoid(beta), cu_seqlens=cu)
    return gated_rms_norm(o, gate, norm_w), state


def _accuracy_case(batch: int, length: int, heads: int, lengths, dev: str):
    """A smaller problem of the same kind for the float64 check: inputs, cu_seqlens (device, cpu)."""
    if lengths is None:
        return _inputs(min(batch, 2), min(length, ACC_TOKENS), heads, dev), None, None
    short = [min(n, ACC_TOKENS) for n in lengths[:2]]
    cu_cpu = torch.tensor([0, *torch.tensor(short).cumsum(0).tolist()], dtype=torch.int64)
    return _inputs(1, sum(short), heads, dev), cu_cpu.to(dev), cu_cpu


def ours_block(x, params, cu: torch.Tensor | None, cu_cpu: torch.Tensor | None, **tuning):
    del cu  # ours takes cu_seqlens on the CPU: no device sync, CUDA-graph capturable
    y, state, _ = prefill_triton.kda_prefill_block(*x, *params, cu_seqlens=cu_cpu, **tuning)
    return y, state


def _accuracy_oracle(heads: int, batch: int, length: int, lengths) -> tuple:
    """(params, inputs, cu_seqlens on the device and the CPU, float64 y and final state) of the accuracy case.
    The oracle runs on the CPU: float64 batched triangular solves on the H200 faulted here (gVisor)."""
    params = _params(heads, "cuda")
    x, cu, cu_cpu = _accuracy_case(batch, length, heads, lengths, "cuda")
    y64, s64 = float64_block([t.cpu() for t in x], [p.cpu() for p in params], cu_cpu)
    return params, x, cu, cu_cpu, y64, s64


def _errors(block, oracle: tuple) -> dict:
    """Relative errors of y and the final state against the float64 block, on the accuracy case."""
    params, x, cu, cu_cpu, y64, s64 = oracle
    try:
        y, s = block(x, params, cu, cu_cpu)
        return {"y_rel_err": rel_err(y.cpu(), y64), "state_rel_err": rel_err(s.cpu(), s64)}
    except Exception:  # noqa: BLE001 - still time what runs
        return {"error": traceback.format_exc()[-400:]}


def block_bytes(tokens: int, heads: int) -> float:
    """Bytes that must move: q, k, v, z, gate in and y out (bf16), beta; the final state (fp32)."""
    return tokens * heads * (6 * D + 1) * 2


def _case(batch: int, length: int, heads: int, lengths):
    params = _params(heads, "cuda")
    cu = cu_cpu = None
    if lengths is not None:
        cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        cu, length = cu_cpu.cuda(), sum(lengths)
    return params, _inputs(batch, length, heads, "cuda"), cu, cu_cpu, block_bytes(batch * length, heads)


def _measure(label: str, impl: str, fn, nbytes: float, extra: dict) -> Row:
    try:
        ms, how = time_ms(fn, inner=5, reps=10)
        row = Row("kda_prefill_block", label, impl, ms, nbytes, note=how,
                  extra=dict(extra, kernels_ms=kernel_ms(fn)))
    except Exception:  # noqa: BLE001 - one failing variant must not hide the others
        row = Row("kda_prefill_block", label, impl, float("nan"), note=traceback.format_exc()[-400:], extra=extra)
    print(f"{label} {impl}: {row.ms:.4f} ms {row.note[-200:]} {row.extra}", file=sys.stderr, flush=True)
    if os.environ.get("KDA_PREFILL_ROWS"):  # one JSON line per row as it is measured: a later fault keeps it
        with open(os.environ["KDA_PREFILL_ROWS"], "a") as f:
            f.write(json.dumps(row.as_dict()) + "\n")
    return row


def prefill_rows(shapes=None, variants=None) -> list[Row]:
    """The peer at every shape (unless KDA_PREFILL_PEER says otherwise), then ours variant by variant (so
    that a variant that faults the device loses only what follows it), each called once on the timed
    inputs, checked against the float64 block and profiled per kernel (the per-stage breakdown). Until
    round 4 the accuracy case came first, so fla's autotuning picked its configs on 160 tokens.
    KDA_PREFILL_PEER=0 skips the fla peer (its autotuning takes ~50 s per shape on the H200); =last times it
    after ours (when ours is known not to fault, so that a time limit cuts the peer's last shapes, not ours);
    =second after ours' first variant and before the others (a variant never run on the device that faults
    then loses only the variants after it, not the same-run comparison of the first with the peer)."""
    variants = selected_variants() if variants is None else variants
    shapes = selected_shapes() if shapes is None else shapes
    rows: list[Row] = []
    when = os.environ.get("KDA_PREFILL_PEER", "1")  # 0: no peer; last / second: see above
    peer = [("fla-core composition", fla_block, {})] if when != "0" else []
    ours = [(f"ours({name})", ours_block, tuning) for name, tuning in variants]
    runs = {"last": ours + peer, "second": ours[:1] + peer + ours[1:]}.get(when, peer + ours)
    with torch.inference_mode():
        oracles = [_accuracy_oracle(heads, batch, length, lengths) for _, batch, length, heads, lengths
                   in shapes]
        for impl, impl_block, tuning in runs:
            for (label, batch, length, heads, lengths), oracle in zip(shapes, oracles, strict=True):
                params, x, cu, cu_cpu, nbytes = _case(batch, length, heads, lengths)
                block = partial(impl_block, **tuning)
                fn = partial(block, x, params, cu, cu_cpu)
                try:  # fla autotunes at its first call, on keys without T: tune it on the timed shape
                    fn()
                except Exception:  # noqa: BLE001 - the accuracy check and the timing report the failure
                    traceback.print_exc()
                if impl_block is ours_block and "block_v" not in tuning:  # check the timed shape's path
                    fused = prefill_triton.fuses_output(lengths or [length] * batch, heads, x[0].device)
                    block = partial(impl_block, **{"fuse_output": fused, **tuning})
                err = _errors(block, oracle)
                rows.append(_measure(label, impl, fn, nbytes, err))
                del x
    return rows


def warm_peer(shape_prefix: str) -> None:
    """One call of the fla block at the first shape whose label starts with `shape_prefix`: fills Triton's
    on-disk kernel cache, so that a later process's autotuning only benchmarks (its compiles, ~50 s per new
    shape on the H200, were most of the peer's cost). Run with FLA_CACHE_RESULTS=0 when several run at once:
    their contended autotuning results must not be kept."""
    _, batch, length, heads, lengths = next(s for s in SHAPES if s[0].startswith(shape_prefix))
    params, x, cu, cu_cpu, _ = _case(batch, length, heads, lengths)
    with torch.inference_mode():
        fla_block(x, params, cu, cu_cpu)
    torch.cuda.synchronize()


def warm_ours() -> None:
    """Ours once per selected variant at a small case of every shape's head count (plain and packed), with the
    split and the fused recurrence (a small case has too few sequences x heads to fuse by itself): the Triton
    compiles (a few seconds per variant) then come from the on-disk cache when the variants are timed."""
    with torch.inference_mode():
        for _, tuning in selected_variants():
            for heads, cu in {(s[3], s[4] is not None) for s in SHAPES}:
                cu_cpu = torch.tensor([0, 100, 256]) if cu else None
                for fuse in (False, True):
                    ours_block(_inputs(1, 256, heads, "cuda"), _params(heads, "cuda"), None, cu_cpu,
                               **{"fuse_output": fuse, **tuning})
    torch.cuda.synchronize()


if __name__ == "__main__":
    # python -m kernels.perf.kda_prefill_cases ROWS.jsonl...: the picked tuning, as JSON;
    # python -m kernels.perf.kda_prefill_cases --warm-peer SHAPE_PREFIX / --warm-ours: see warm_peer, warm_ours.
    if sys.argv[1:2] == ["--warm-peer"]:
        warm_peer(sys.argv[2])
    elif sys.argv[1:2] == ["--warm-ours"]:
        warm_ours()
    else:
        print(json.dumps(pick_from_files(sys.argv[1:])))
