"""KDA prefill block in Triton: projections -> gated, normalised output, chunkwise (C = 64), varlen.

Four passes (the output norm epilogue never takes a pass of its own):
1. `prefill_prep_triton`: per (chunk, head), ShortConv + Swish + L2Norm + gate cumsum + sigmoid(beta).
2. `prefill_chunk_triton`: per (chunk, head), chunk-major, the chunk's UT transform -> w, u, qg, kg, Aqk,
   exp(G_C).
3. `prefill_recurrence_triton`: per (value block, head, sequence), longest sequence first, the recurrence
   across the chunks, the state on chip; it stores the state entering each chunk (bf16) and v_new.
4. `prefill_recurrence_triton`: per (chunk, head), chunk-major, the output o = qg S_in + Aqk v_new, then
   RMSNorm x w x sigmoid(gate) -> y.
This module plans and launches them.
With many, balanced sequences 3 and 4 are one pass (one program per sequence and head: the chunk-entry
states and v_new stay on chip). The final conv windows are written by the recurrence (value block 0),
also for empty sequences.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from k3core.layers.weight_derivation import WeightDerivation
from kernels._triton import next_pow2, require, sm_count
from kernels.kda import naive
from kernels.kda.prefill_chunk_triton import CHUNK, SUB, _kda_chunk_ut_kernel
from kernels.kda.prefill_prep_triton import _kda_prep_kernel
from kernels.kda.prefill_recurrence_triton import _kda_chunk_output_kernel, _kda_chunk_recurrence_kernel


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision of the float32 dots: TF32 (10-bit mantissa) for 16-bit activations, whose operands
    are coarser already; for float32 activations, what torch's matmuls use (torch.set_float32_matmul_precision:
    IEEE at its default "highest"). TF32 there put the block 1e-3 (relative) from the torch path, which the
    nano model's top-k routing amplified to logits 0.44 apart on the H200 (the interpreter's dots are exact)."""
    exact = dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return "ieee" if exact else "tf32"


def fuses_output(lengths: Sequence[int], heads: int, device: torch.device) -> bool:
    """The default of kda_prefill_block's fuse_output for sequences of `lengths` tokens: one program per
    sequence and head must fill the SMs, and the longest sequence must not hold many more chunks than the
    mean (its programs' serial chain sets the pass's time). H200: B=8 x 4K, H=32 fused 3.93 vs 4.04 ms;
    the varlen batch (12K longest, 4.2K mean) fused 4.81 vs 4.35 ms."""
    chunks = [-(-n // CHUNK) for n in lengths]
    balanced = max(chunks, default=0) <= 1.25 * sum(chunks) / max(len(chunks), 1)
    return len(chunks) * heads >= sm_count(device, cpu=4) and balanced


@functools.lru_cache(maxsize=64)
def chunk_plan(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(cu_seqlens, chunk_seq [NC], chunk_start [NC], chunk_offsets [N+1], seq_order [N]) int32 on `device`
    for sequence bounds [N+1]; seq_order: the sequences by chunk count, most first (the recurrence's launch
    order). Cached, so that repeated shapes (and CUDA-graph capture) need no host round trip."""
    counts = [-(-(b - a) // CHUNK) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    seq = [n for n, c in enumerate(counts) for _ in range(c)]
    start = [bounds[n] + i * CHUNK for n, c in enumerate(counts) for i in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    longest = sorted(range(len(counts)), key=lambda n: -counts[n])
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (bounds, seq, start, offsets, longest))


def tap_major(conv_weight: torch.Tensor) -> torch.Tensor:
    """The conv weights [3, H*D, W] tap-major, [3, W, H*D] (what the prep pass reads: a tap's weights for a
    thread's channels are one vector load, where [3, H*D, W] took one 16-bit load per channel; sm_90a: 31 vs
    59 global loads per prep program; H200, same run: prep 1.02 -> 0.88 ms at B=8, T=4K, H=32). Derived once
    per weight tensor and kept on it (a layer passes the same cached stacked weight every call); rebuilt when
    the tensor changed in place or moved (WeightDerivation), on every call for inference tensors (no version
    counter) and during CUDA-graph capture (the graph then transposes on every replay, as before caching)."""
    def build(weights):
        return weights[0].transpose(1, 2).contiguous()

    if conv_weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return build([conv_weight])
    derived = getattr(conv_weight, "_k3_tap_major", None)
    if derived is None:
        derived = conv_weight._k3_tap_major = WeightDerivation(build)
    return derived.get([conv_weight])


def _sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> tuple[int, ...]:
    if cu_seqlens is None:
        return tuple(range(0, batch * length + 1, length)) if length else (0,) * (batch + 1)
    require(batch == 1, f"cu_seqlens needs batch size 1 (packed sequences), got {batch}")
    require(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2, "cu_seqlens must be a 1-D tensor [N+1]")
    bounds = tuple(int(x) for x in cu_seqlens.tolist())  # a host copy: pass cu_seqlens on the CPU to avoid a sync
    rising = all(b >= a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    require(bounds[0] == 0 and bounds[-1] == length and rising,
            f"cu_seqlens must rise from 0 to T={length}, got {bounds}")
    return bounds


def _check(q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight) -> None:
    B, T, H, D = q.shape
    for name, t in (("k", k), ("v", v), ("z", z), ("gate", gate)):
        require(t.shape == q.shape, f"{name} must be {tuple(q.shape)} like q, got {tuple(t.shape)}")
    require(beta.shape == (B, T, H), f"beta must be [{B}, {T}, {H}], got {tuple(beta.shape)}")
    require(D == next_pow2(D) and D >= 16, f"head dim must be a power of two >= 16, got {D}")
    require(conv_weight.dim() == 3 and conv_weight.shape[:2] == (3, H * D),
            f"conv_weight must be [3, {H * D}, W], got {tuple(conv_weight.shape)}")
    require(A_log.shape == (H,), f"A_log must be [{H}], got {tuple(A_log.shape)}")
    require(dt_bias.numel() == H * D, f"dt_bias must hold H*K={H * D} values, got {dt_bias.numel()}")
    require(norm_weight.shape == (D,), f"norm_weight must be [{D}], got {tuple(norm_weight.shape)}")


def kda_prefill_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, initial_state: torch.Tensor | None = None,
    initial_conv: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6, block_v: int | None = None, k_block: int | None = None, num_warps: int = 4,
    prep_warps: int = 8, ut_warps: int = 4, recurrence_warps: int = 4, stages: int = 3, f32_dots: bool = False,
    ut_maxnreg: int | None = 168, few_block_v: int = 16, ut_stages: int = 3, fuse_output: bool | None = None,
    fused_warps: int = 8, fused_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.kda.naive.kda_prefill_block, plus tuning arguments.

    The softplus gate (lower_bound=None) is unbounded, so the sub-block decay split is not safe for it:
    that case runs the reference. Tuning (H200 measurements in docs/kernels.md):
    - block_v: value columns per recurrence program (default 64, or few_block_v when sequences x heads are
      few: 64-column programs would leave most SMs idle). few_block_v 16 vs 32 at B=1, T=32K, H=16 (128
      programs vs 64): recurrence 0.58 -> 0.47 ms at 3 stages.
    - k_block: key columns per step of the UT-transform pass (a divisor of D, >= 16; default 32; 16: UT
      pass 1.13 vs 0.98 ms at B=1, T=32K, H=16).
    - num_warps: the output pass; prep_warps: the prologue pass (8: no spills, 4 spills); ut_warps: the
      UT-transform pass; recurrence_warps.
    - stages: software-pipelining depth of the recurrence's chunk loop: 3 (each chunk's w, u, kg loads
      issued two chunks ahead) vs 2: recurrence 0.87 -> 0.58 ms at B=1, T=32K, H=16 (32 columns).
    - ut_stages: software-pipelining depth of the UT pass's key-block loops (ptxas, sm_90a: 3 -> 69 KB of
      shared memory and 72 B of spills under the 168 cap, 2 -> 49 KB and 24 B).
    - ut_maxnreg: register cap of the UT pass (None: none). ptxas (sm_90a): 213 registers at k_block 32 = 2
      programs per SM; under 168 (16 B of spills) 3 fit: UT pass 1.34 -> 1.14 ms at B=1, T=32K on the H200.
    - f32_dots: float32 operands in the UT transform's dots instead of the input dtype (TF32 unless
      dot_precision says IEEE). Always for float16 activations: the decay factors on the diagonal sub-block
      reach 2^115 and overflow float16's range (NaN outputs at ordinary gates); TF32 keeps float16's
      10-bit mantissa with float32's range.
    - fuse_output: the output pass inside the recurrence (one program per sequence and head, all value
      columns, `fused_warps` warps), which saves writing and reading back the chunk-entry states and v_new.
      Default (`fuses_output`; never with an explicit block_v, which True overrides): sequences x heads fill
      the SMs (B=8, H=32: 256 programs) and no sequence holds over 1.25x the mean chunk count; with few of
      them (B=1, H=16) the recurrence needs its value-column split to have enough programs. fused_stages:
      its chunk loop's pipelining depth (3 needs 288 KB of shared memory on sm_90a: 2, 197 KB, fits).
    cu_seqlens may live on the CPU (no device sync then)."""
    args = (q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight)
    if lower_bound is None:
        return naive.kda_prefill_block(*args, initial_state, initial_conv, cu_seqlens, lower_bound, scale,
                                       l2_eps, norm_eps)
    require(lower_bound * SUB > -87.0, f"lower_bound {lower_bound} is too low for the {SUB}-token decay split")
    _check(*args)
    B, T, H, D = q.shape
    W = conv_weight.shape[-1]
    bounds = _sequence_bounds(cu_seqlens, B, T)
    N = len(bounds) - 1
    if initial_state is not None:
        require(initial_state.shape == (N, H, D, D), f"initial_state must be [{N}, {H}, {D}, {D}], got "
                f"{tuple(initial_state.shape)}")
    if initial_conv is not None:
        require(initial_conv.shape == (N, 3, H, D, W - 1), f"initial_conv must be [{N}, 3, {H}, {D}, {W - 1}], "
                f"got {tuple(initial_conv.shape)}")
    k_block = k_block or min(32, D)
    require(D % k_block == 0 and k_block >= 16, f"k_block must divide {D} and be >= 16, got {k_block}")
    dev = q.device
    cu, chunk_seq, chunk_start, chunk_offsets, seq_order = chunk_plan(bounds, dev)
    n_chunks = chunk_seq.numel()
    grid = (n_chunks * H,)  # the UT and output passes, chunk-major (prefill_chunk_triton._chunk_head)
    q, k, v, z, beta, gate = (t.contiguous() for t in (q, k, v, z, beta, gate))
    work = [torch.empty_like(q) for _ in range(4)]  # w, u, qg, kg
    aqk = torch.empty(B, T, H, CHUNK, device=dev, dtype=q.dtype)
    gc = torch.empty(max(n_chunks, 1), H, D, device=dev, dtype=torch.float32)
    scale = D**-0.5 if scale is None else scale
    conv = initial_conv.contiguous() if initial_conv is not None else q
    shape = {"H": H, "D": D, "C": CHUNK}
    dot = dot_precision(q.dtype)
    if n_chunks:
        qn, kn, vc = (torch.empty_like(q) for _ in range(3))
        g = torch.empty(q.shape, device=dev, dtype=torch.float32)
        beta_f = torch.empty(beta.shape, device=dev, dtype=torch.float32)
        _kda_prep_kernel[(n_chunks, H, 3)](
            q, k, v, z, beta, tap_major(conv_weight), A_log, dt_bias.contiguous(), conv, cu,
            chunk_seq, chunk_start, qn, kn, vc, g, beta_f, lower_bound, l2_eps, **shape, W=W,
            HAS_CONV=initial_conv is not None, num_warps=prep_warps)
        _kda_chunk_ut_kernel[grid](
            qn, kn, vc, g, beta_f, cu, chunk_seq, chunk_start, *work, aqk, gc, scale, **shape, BC=SUB,
            BK=k_block, F32_DOTS=f32_dots or q.dtype == torch.float16, DOT=dot, num_warps=ut_warps,
            num_stages=ut_stages, maxnreg=ut_maxnreg)
    if fuse_output is None:  # an explicit block_v asks for the split recurrence
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        fuse_output = not block_v and fuses_output(lengths, H, dev)
    if fuse_output:
        block_v, recurrence_warps, stages = D, fused_warps, fused_stages
    elif not block_v:
        block_v = min(64 if N * H * (D // 64) >= 2 * sm_count(dev, cpu=1) else few_block_v, D)
    require(D % block_v == 0 and block_v >= 16, f"block_v must divide {D} and be >= 16, got {block_v}")
    y = torch.empty_like(q)
    final_state = torch.empty(N, H, D, D, device=dev, dtype=torch.float32)
    final_conv = torch.empty(N, 3, H, D, W - 1, device=dev, dtype=q.dtype)
    # Fused, the chunk-entry states and v_new never leave the chip: placeholders (never dereferenced).
    h_states = gc if fuse_output else torch.empty(max(n_chunks, 1), H, D, D, device=dev, dtype=q.dtype)
    v_new = q if fuse_output else torch.empty_like(q)
    w, u, qg, kg = work
    require(N < 65536, f"at most 65535 sequences (the recurrence grid's third axis), got {N}")
    _kda_chunk_recurrence_kernel[(D // block_v, H, N)](  # longest sequence first: seq_order
        w, u, kg, gc, h_states, v_new, initial_state.contiguous() if initial_state is not None else gc,
        final_state, q, k, v, conv, final_conv, cu, chunk_offsets, seq_order, qg, aqk, gate, norm_weight, y,
        norm_eps, **shape, W=W, BWM=next_pow2(W - 1), BV=block_v, HAS_STATE=initial_state is not None,
        HAS_CONV=initial_conv is not None, STAGES=stages, DOT=dot, FUSED_OUT=fuse_output,
        num_warps=recurrence_warps,
    )
    if n_chunks and not fuse_output:
        _kda_chunk_output_kernel[grid](
            qg, aqk, h_states, v_new, gate, norm_weight, y, cu, chunk_seq, chunk_start, norm_eps,
            **shape, DOT=dot, num_warps=num_warps,
        )
    return y, final_state, final_conv
