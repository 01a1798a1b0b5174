"""The latent-MoE decode's gate/up step on FP8 warpgroup MMAs (opt-in; GPU only, Gluon has no interpreter).

Why: the bf16 decode costs 12 integer / bf16 operations a word of 8 codes (4 rotations, 4 lop3, 4 bf16x2
multiplies by the group's scale). Here the codes are decoded to e4m3 (k3core.quant.mxfp4_device's e4m3 layout:
2 registers of 4 bytes a word, 4 integer operations, no multiply), and the group's scale is applied to the
float32 result of the group's own MMA (K = 32 = one MXFP4 block): acc += tmp * 2^(e - 121), the multiplier
one shift of a load-time byte. Hopper has e4m3 only on its warpgroup MMAs: mma.sync m16n8k32 e4m3 is
emulated by ptxas on sm_90 (each becomes 2 f16 HMMAs plus F2FP unpacks, PRMTs and FADDs: more instructions a
word than the bf16 decode, docs/kernels.md history 47), so this is decode_wgmma_gluon's form: a program is one warpgroup on
64 gate and 64 up rows (the MMA's M side, decoded in registers into wgmma's A fragments), the expert's token
slots the N side from shared memory (N = 8 up to 8 tokens: half the float32 multiply-adds, else 16).

Its operands (the e4m3 weight layout, `prepare_weights`, and the activations split into e4m3 hi + lo in the
MMA's K order, `split_activations`) are kernels.moe.fp8_operands_triton's.
"""

from __future__ import annotations

import torch

from k3core.quant.mxfp4_device import E4M3_MASK, E4M3_ROTATIONS
from kernels._triton import next_pow2, require
from kernels.moe.fp8_operands_triton import _e4m3_grid, split_activations
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon

ROWS, WARPS = 64, 4  # one warpgroup, one wgmma M tile of gate rows and one of up rows


def _decode_asm() -> str:
    """PTX of one e4m3-layout word ($2) -> its 2 registers ($0, $1), from the layout's rotations and mask."""
    lines = []
    for j, rots in enumerate(E4M3_ROTATIONS):
        rotated = []
        for r in rots:
            if r:
                lines.append(f"shf.r.wrap.b32 r{r}, $2, $2, {r};")
            rotated.append(f"r{r}" if r else "$2")
        a, b = (rotated + rotated)[:2]
        lut = 0xA0 if len(rots) == 1 else 0x28  # over (a=0xF0, b=0xCC, c=0xAA): a & c, or (a ^ b) & c
        lines.append(f"lop3.b32 ${j}, {a}, {b}, {E4M3_MASK:#x}, {lut:#x};")
    regs = sorted({r for rots in E4M3_ROTATIONS for r in rots if r})
    return "{\n.reg .b32 " + ", ".join(f"r{r}" for r in regs) + ";\n" + "\n".join(lines) + "\n}"


if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels.moe.decode_gluon import situ_glu
    from kernels.moe.decode_wgmma_gluon import _words_layout
    from kernels.moe.mxfp4_stream_gluon import (
        block_tile,
        copy_tile,
        expert_tokens,
        fields_ring,
        slots,
        words_ring,
    )

    _ROWS, _SLOTS = gl.constexpr(ROWS), gl.constexpr(SLOTS)
    _round_to_e4m3_gl = gluon.jit(_e4m3_grid)
    _DECODE = gl.constexpr(_decode_asm())

    @gluon.constexpr_function
    def _mma(n):
        """Accumulators of 64 rows x n token slots (n = 8 or 16: the MMA's N)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])

    # A stage of activations: rows (hi / lo, group, slot), 32 e4m3 columns (one group, MMA K order).
    _X_SHARED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2))
    _X_COPY = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))
    # [64 rows, 4 groups] multiplier bytes as the accumulators hold the rows (lanes of a quad alike).
    _FIELDS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))

    @gluon.jit
    def _gather(v, index, layout: gl.constexpr):
        """v[index] for a [16] slot vector v and an index vector in SliceLayout(1, `layout`) (a one-hot sum)."""
        slot = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
        hit = index[:, None] == slot[None, :]
        return gl.sum(gl.where(hit, gl.convert_layout(v, gl.SliceLayout(0, layout))[None, :], 0), 1)

    @gluon.jit
    def _x_rows(xq, slot_pair, used, K, L, N: gl.constexpr):
        """Per row of an activation stage (hi / lo, group, slot < N) its source row pointer and mask."""
        r = gl.arange(0, 8 * N, layout=gl.SliceLayout(1, _X_COPY))
        tok = _gather(slot_pair, r % N, _X_COPY) // K
        ok = _gather(used.to(gl.int32), r % N, _X_COPY) > 0
        rows = gl.multiple_of(tok.to(gl.int64) * (2 * L) + (r // (4 * N)) * L + ((r // N) % 4) * 32, 32)
        return xq + rows, ok

    @gluon.jit
    def _copy_x(ring, buf, rows, ok, step):
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, _X_COPY))
        offsets = gl.max_contiguous(gl.multiple_of(step * 128 + cols, 16), 16)
        async_copy.async_copy_global_to_shared(ring.index(buf), rows[:, None] + offsets[None, :], mask=ok[:, None])

    @gluon.jit
    def _fill(x_s, a_s, a_f, b_s, b_f, buf, x_rows, x_ok, a_words, a_fields, b_words, b_fields, step):
        """Ring stage `buf` <- step `step`'s activation rows and both weight tiles (words and fields)."""
        _copy_x(x_s, buf, x_rows, x_ok, step)
        copy_tile(a_s, a_f, buf, a_words, a_fields, step)
        copy_tile(b_s, b_f, buf, b_words, b_fields, step)

    @gluon.jit
    def _next_step(x_s, a_s, a_f, b_s, b_f, x_rows, x_ok, a_words, a_fields, b_words, b_fields, i, step0,
                   STEPS: gl.constexpr, STAGES: gl.constexpr):
        """The ring at loop step i (both FP8 kernels): step i's stage waited for and made visible, then the stage
        freed by step i - 1 refilled with step i + STAGES - 1 (of STEPS, counted from step0)."""
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()  # this thread's copies of step i, seen by the MMAs' reads
        gl.thread_barrier()  # step i landed everywhere; the previous step's MMAs and reads are done
        nxt = i + STAGES - 1
        if nxt < STEPS:
            _fill(x_s, a_s, a_f, b_s, b_f, nxt % STAGES, x_rows, x_ok, a_words, a_fields, b_words, b_fields,
                  step0 + nxt)
        async_copy.commit_group()

    @gluon.jit
    def _split4(t):
        """[..., 2, 2] (index 2 a + b) -> its 4 slices in index order."""
        a, b = gl.split(t)
        a0, a1 = gl.split(a)
        b0, b1 = gl.split(b)
        return a0, b0, a1, b1

    @gluon.jit
    def _weights(words_s, buf, N: gl.constexpr):
        """Stage `buf`'s [64, 16] transposed words -> 4 e4m3 [64, 32] A operands (one a group, MMA K order)."""
        w = words_s.index(buf).load(_words_layout(_ROWS)).to(gl.uint32, bitcast=True)
        r0, r1 = gl.inline_asm_elementwise(_DECODE, "=r,=r,r", [w], dtype=(gl.uint32, gl.uint32), is_pure=True,
                                           pack=1)
        r = gl.join(r0, r1)  # [64, 16 (t, G), 2 (h)]
        r = gl.join(gl.join(r, r), gl.join(r, r))  # [64, 16, 2, 2, 2]: each register 4 times, one a byte
        b = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [r], dtype=gl.float8e4nv, is_pure=True,
                                      pack=4)
        b = gl.reshape(b, [_ROWS, 4, 4, 2, 4])  # [row, t, G, h, i]
        b = gl.reshape(gl.permute(b, [0, 3, 1, 4, 2]), [_ROWS, 32, 4])  # [row, (h t i) = k, G]
        g0, g1, g2, g3 = _split4(gl.reshape(b, [_ROWS, 32, 2, 2]))
        a: gl.constexpr = gl.DotOperandLayout(0, _mma(N), 4)
        return (gl.convert_layout(g0, a, assert_trivial=True), gl.convert_layout(g1, a, assert_trivial=True),
                gl.convert_layout(g2, a, assert_trivial=True), gl.convert_layout(g3, a, assert_trivial=True))

    @gluon.jit
    def _multipliers(fields_s, buf, N: gl.constexpr):
        """Stage `buf`'s [64, 4] fields -> 4 float32 [64] group multipliers 2^(e - 121) in the accumulators'
        rows."""
        f = fields_s.index(buf).load(_FIELDS).to(gl.uint32)
        m = (f << 23).to(gl.float32, bitcast=True)
        m0, m1, m2, m3 = _split4(gl.reshape(m, [_ROWS, 2, 2]))
        rows: gl.constexpr = gl.SliceLayout(1, _mma(N))
        return (gl.convert_layout(m0, rows, assert_trivial=True), gl.convert_layout(m1, rows, assert_trivial=True),
                gl.convert_layout(m2, rows, assert_trivial=True), gl.convert_layout(m3, rows, assert_trivial=True))

    @gluon.jit
    def _group_mma(a, x_s, lo_s, G: gl.constexpr, N: gl.constexpr):
        """Group G's hi and lo MMAs into a fresh float32 tmp (async); lo_s: the stage `x_s` (e4m3 lo) or its
        view with another element type."""
        hi = x_s.slice(N * G, N).permute([1, 0])
        lo = lo_s.slice(N * (4 + G), N).permute([1, 0])
        tmp = warpgroup_mma(a, hi, gl.zeros([_ROWS, N], gl.float32, _mma(N)), use_acc=False, is_async=True)
        return warpgroup_mma(a, lo, tmp, is_async=True)

    @gluon.jit
    def _issue(w_s, x_s, lo_s, buf, N: gl.constexpr):
        """A 64-row matrix's step: decode, and its 4 groups' MMAs issued (async)."""
        a0, a1, a2, a3 = _weights(w_s, buf, N)
        return (_group_mma(a0, x_s, lo_s, 0, N), _group_mma(a1, x_s, lo_s, 1, N), _group_mma(a2, x_s, lo_s, 2, N),
                _group_mma(a3, x_s, lo_s, 3, N))

    @gluon.jit
    def _scaled(acc, f_s, buf, t0, t1, t2, t3, N: gl.constexpr):
        """acc + the groups' finished MMAs, each times its multipliers."""
        m0, m1, m2, m3 = _multipliers(f_s, buf, N)
        return acc + t0 * m0[:, None] + t1 * m1[:, None] + t2 * m2[:, None] + t3 * m3[:, None]

    @gluon.jit
    def _store_fp8_parts(h, y, pair, ok, rows, F):
        """y [64 rows of h, N slots] (|y| <= 448) -> hi = e4m3(y) and lo = e5m2(y - hi) (e5m2: 16 binades
        below e4m3's, so small y keep their bits) at h [T k, 2, F] bytes, rows `pair`, columns `rows` at their
        positions in the MMA's K order (the inverse of fp8_operands_triton.mma_k_columns)."""
        c = rows % 32
        k = rows - c + 16 * ((c % 8) // 4) + 4 * (c // 8) + c % 4
        hi = _round_to_e4m3_gl(y)
        at = h + pair[None, :] * (2 * F) + k[:, None]
        gl.store(at.to(gl.pointer_type(gl.float8e4nv)), hi.to(gl.float8e4nv), mask=ok[None, :])  # exact
        gl.store((at + F).to(gl.pointer_type(gl.float8e5)), (y - hi).to(gl.float8e5), mask=ok[None, :])

    @gluon.jit
    def gate_up_rows(xq, xs, ids, wgu, mgu, h, lead, row0, T, K, F, beta1, beta2, L: gl.constexpr,
                     TP: gl.constexpr, BK: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr, N: gl.constexpr,
                     HS: gl.constexpr):
        """One FP8 gate/up program's work: rows row0 .. row0 + 64 of h for the tokens of pair `lead`'s expert,
        where `lead` leads it (both gate_up_kernel and decode_fp8_fused_gluon's one-launch kernel)."""
        WORDS: gl.constexpr = L // 8
        STEPS: gl.constexpr = L // 128
        e, leader, first, _match, _index = expert_tokens(ids, lead, T, K, TP, BK, 4)
        if leader:
            _hit, slot_pair, used = slots(first, 4)
            gate_words, gate_fields = block_tile(row0, WORDS, _ROWS, 4)
            words = wgu + e * (2 * F) * WORDS + gate_words
            fields = mgu + e * (2 * F) * (WORDS // 4) + gate_fields
            up_words, up_fields = words + F * WORDS, fields + F * (WORDS // 4)
            x_rows, x_ok = _x_rows(xq, slot_pair, used, K, L, N)
            x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 8 * N, 32], _X_SHARED)
            gate_s, gate_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            up_s, up_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            for s in gl.static_range(STAGES - 1):
                if s < STEPS:
                    _fill(x_s, gate_s, gate_f, up_s, up_f, s, x_rows, x_ok, words, fields, up_words, up_fields, s)
                async_copy.commit_group()
            g = gl.zeros([_ROWS, N], gl.float32, _mma(N))
            u = gl.zeros([_ROWS, N], gl.float32, _mma(N))
            for i in range(STEPS):
                _next_step(x_s, gate_s, gate_f, up_s, up_f, x_rows, x_ok, words, fields, up_words, up_fields, i, 0,
                           STEPS, STAGES)
                buf = i % STAGES
                x_b = x_s.index(buf)
                g0, g1, g2, g3 = _issue(gate_s, x_b, x_b, buf, N)
                u0, u1, u2, u3 = _issue(up_s, x_b, x_b, buf, N)  # decoded while the gate MMAs run
                # (the 8-bit A operands cannot be deps; ptxas keeps their registers until the wait)
                g0, g1, g2, g3, u0, u1, u2, u3 = warpgroup_mma_wait(0, deps=[g0, g1, g2, g3, u0, u1, u2, u3])
                g = _scaled(g, gate_f, buf, g0, g1, g2, g3, N)
                u = _scaled(u, up_f, buf, u0, u1, u2, u3, N)
            cols: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])  # [N, 16] slot gathers
            slot = gl.arange(0, N, layout=gl.SliceLayout(1, cols))
            pair = gl.convert_layout(_gather(slot_pair, slot, cols), gl.SliceLayout(0, _mma(N)))
            ok = gl.convert_layout(_gather(used.to(gl.int32), slot, cols) > 0, gl.SliceLayout(0, _mma(N)))
            scale = gl.load(xs + pair // K, mask=ok, other=0.0)
            rest = situ_glu(g * scale[None, :], u * scale[None, :], beta1, beta2)
            rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, _mma(N)))
            if HS == 0.0:
                for p in gl.static_range(HP):
                    part = rest.to(gl.bfloat16)
                    gl.store(h + (p * T * K + pair[None, :]) * F + rows[:, None], part,
                             mask=ok[None, :] & (rows < F)[:, None])
                    rest = rest - part.to(gl.float32)
            else:
                _store_fp8_parts(h, rest * HS, pair, ok, rows, F)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_kernel(xq, xs, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                       BK: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr, N: gl.constexpr,
                       HS: gl.constexpr = 0.0):
        """Grid (T k, F / 64), 4 warps: as decode_wgmma_gluon.gate_up_kernel from `split_activations`' xq / xs
        and fp8_operands_triton.prepare_weights' words / fields, for experts of at most N tokens (T <= N). HS = 0:
        h in HP bf16 parts [HP, T k, F]; else h / s as hi + lo bytes [T k, 2, F] (e4m3, e5m2) in the MMA's K
        order, HS = 1 / s (a power of two; decode_fp8_down_gluon's input)."""
        gate_up_rows(xq, xs, ids, wgu, mgu, h, gl.program_id(0), gl.program_id(1) * _ROWS, T, K, F, beta1, beta2, L,
                     TP, BK, HP, STAGES, N, HS)


def serves(x: torch.Tensor, F: int) -> bool:
    """Whether `gate_up` computes this call: CUDA with Gluon, bf16 x of at most 16 tokens, l a power of two of at
    least 2 steps of 128 columns, F a multiple of 64."""
    T, L = x.shape
    return (gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and T <= SLOTS and L == next_pow2(L)
            and L >= 256 and F % ROWS == 0)


def gate_up(x: torch.Tensor, ids: torch.Tensor, words: torch.Tensor, mults: torch.Tensor, h: torch.Tensor,
            beta1: float, beta2: float, stages: int, h_scale: float | None = None) -> None:
    """h [parts, T k, F] <- the SiTU-GLU of the routed experts' gate and up rows for x [T, l] (`serves` must
    hold; words / mults from fp8_operands_triton.prepare_weights). `h_scale` (a power of two s with |h| / s <= 448, see
    decode_fp8_down_gluon.h_scale): h instead uint8 [T k, 2, F], h / s = hi (e4m3) + lo (e5m2), columns in the
    MMA's K order."""
    T, L = x.shape
    K = ids.shape[1]
    F = words.shape[1] // 2
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    fp8_h = {} if h_scale is None else {"HS": 1.0 / h_scale}
    require(h_scale is None or (h.shape == (T * K, 2, F) and h.dtype == torch.uint8),
            f"an fp8 h must be uint8 [{T * K}, 2, {F}], got {tuple(h.shape)} {h.dtype}")
    xq, xs = split_activations(x)
    gate_up_kernel[(T * K, F // ROWS)](xq, xs, ids, words, mults, h, T, K, F, beta1, beta2, L=L, TP=SLOTS,
                                       BK=next_pow2(K), HP=h.shape[0] if h_scale is None else 1, STAGES=stages,
                                       N=8 if T <= 8 else 16, num_warps=WARPS, **fp8_h)
