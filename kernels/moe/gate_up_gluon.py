"""The latent-MoE gate/up decode kernel in Gluon (GPU only: Gluon has no CPU interpreter).

The same computation as `latent_moe_decode_triton._gate_up_kernel` for bf16 activations, 64-row x 128-column
steps and 2 warps, with what plain Triton does not let us choose (docs/kernels.md, history 28 and 32):
- the activation tile is staged in a swizzled shared layout, so the tensor-core operand reads have no bank
  conflicts (Triton staged it unswizzled: 16-way conflicts on every LDS.128);
- a ring of STAGES buffers filled by cp.async, with one barrier per step, and the next step's copies issued
  right after it, before this step's shared-memory reads (Triton's pipeline waits, reads, then issues).
The register layouts are the ones Triton derived for the decode (`mxfp4_tile_triton`): the word, multiplier
and activation tiles are read from shared memory straight into them, and every reshape after that is free
(the conversions to the tensor-core operand layouts are asserted trivial at compile time).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require
from kernels.moe.mxfp4_tile_triton import _FIELD_TO_BF16X2, SHIFT, _decode_asm, block_words
from kernels.moe.tiles import Tile

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every caller
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - exercised only where Gluon is absent
    gluon = None

ROWS, COLS, WARPS, SLOTS = 64, 128, 2, 16  # the only tile this kernel is written for
BLOCK_WORDS = 16  # words a row of a stored 32-row block holds (`block_words` of rows of >= 16 words)

if gluon is not None:
    _ROWS, _COLS, _SLOTS, _BW = (gl.constexpr(v) for v in (ROWS, COLS, SLOTS, BLOCK_WORDS))
    _DECODE = gl.constexpr(_decode_asm())
    _FIELDS = gl.constexpr(_FIELD_TO_BF16X2)
    _UNSHIFT = gl.constexpr(2.0**SHIFT)
    _MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 2], instr_shape=[16, 8]))
    _A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=8))
    _B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=8))
    # Routing bookkeeping on [16, 16] tiles (tokens x slots).
    _SMALL = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [2, 1], [1, 0]))
    # Copies: 16 bytes a thread for words and activations, 4 (one row's multipliers) for multipliers.
    _WORDS = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [2, 1], [1, 0]))  # also how the decode reads them
    _MULTS = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [2, 1], [1, 0]))
    _ACT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [2, 1], [1, 0]))
    # The decode's multiplier fields ([rows, group, word of the group], one byte per row and group read) and
    # the activation operand before its column permutation (8 columns a thread, both warps all 16 rows).
    _FIELD_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [16, 0, 0], [32, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[8, 0, 0]],
        block_bases=[], shape=[ROWS, 4, 4]))
    _ACT_READ = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 1], [0, 2], [8, 0], [0, 8], [0, 16]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0]], block_bases=[],
        shape=[SLOTS, COLS]))
    _PLAIN = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    # The activation tile stored as [32, 64] (half rows) with 16-byte chunks XOR-swizzled by half row, read
    # through a [16, 128] view: each quarter-warp's 8 chunks (2 rows x 4 chunks 64 bytes apart) fall in 8
    # different bank groups (gl.bank_conflicts: 0 for the reads and the copies; unswizzled [16, 128] rows
    # give 4x the wavefronts, plain [16, 128] swizzling 2x).
    _ACT_SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))

    @gluon.jit
    def _sigmoid(v):
        return 1.0 / (1.0 + gl.exp(-v))

    @gluon.jit
    def _situ_glu(g, u, beta1, beta2):
        """kernels.moe.situ_glu_triton.situ_glu_values, in Gluon."""
        gate = beta1 * (2 * _sigmoid(2 * g / beta1) - 1) * _sigmoid(g)
        return gate * (beta2 * (2 * _sigmoid(2 * u / beta2) - 1))

    @gluon.jit
    def _routing(ids, pair, T, K, TP: gl.constexpr, BK: gl.constexpr):
        """expert_slots_triton.expert_tokens + slots for one pass of 16 slots (T <= 16): the pair's expert,
        whether the pair leads it, and per slot the token's first pair naming the expert and whether the slot
        is used (slots in token order)."""
        e = gl.load(ids + pair)
        tok = gl.arange(0, TP, layout=gl.SliceLayout(1, _SMALL))
        slot = gl.arange(0, BK, layout=gl.SliceLayout(0, _SMALL))
        index = tok[:, None] * K + slot[None, :]
        match = gl.load(ids + index, mask=(tok[:, None] < T) & (slot[None, :] < K), other=-1) == e
        first = gl.min(gl.where(match, index, 1 << 30), 1)
        routed = (first < (1 << 30)).to(gl.int32)
        # Slot of token t: the routed tokens before it ([t', t] tiles, reduced over t').
        later = gl.arange(0, TP, layout=gl.SliceLayout(0, _SMALL))
        rank = gl.sum(gl.where(tok[:, None] < later[None, :], routed[:, None], 0), 0)
        first_t = gl.convert_layout(first, gl.SliceLayout(0, _SMALL))
        hit = (rank[None, :] == tok[:, None]) & (first_t < (1 << 30))[None, :]
        slot_pair = gl.sum(gl.where(hit, first_t[None, :], 0), 1)
        used = gl.sum(hit.to(gl.int32), 1) > 0
        return e.to(gl.int64), gl.min(first, 0) == pair, slot_pair, used

    @gluon.jit
    def _lane_groups(t):
        """[R, 4, 4] (group, word of the group) -> [R, 16] in mxfp4_tile_triton._lane_groups' order."""
        t = gl.permute(gl.reshape(t, [t.shape[0], 1, 4, 4]), [0, 1, 3, 2])
        return gl.reshape(t, [t.shape[0], 16])

    @gluon.jit
    def _weight_operand(words, fields):
        """A stage's [64, 16] words and [64, 4] multiplier fields -> the bf16 [128, 64] B operand (weights
        x 2^-SHIFT, columns in mxfp4_tile_triton's order)."""
        w = _lane_groups(gl.reshape(words.load(_WORDS).to(gl.uint32, bitcast=True), [_ROWS, 4, 4]))
        f = fields.load(gl.SliceLayout(2, _FIELD_LAYOUT)).to(gl.uint32) * _FIELDS
        m = _lane_groups(f[:, :, None] + gl.full([_ROWS, 4, 4], 0, gl.uint32, _FIELD_LAYOUT))
        m = gl.convert_layout(m, w.type.layout, assert_trivial=True)
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        low = gl.join(gl.join(e0, e2), gl.join(e1, e3))
        high = gl.join(gl.join(e4, e6), gl.join(e5, e7))
        tile = gl.reshape(gl.join(low, high), [_ROWS, _COLS])
        return gl.convert_layout(gl.permute(tile, [1, 0]), _B, assert_trivial=True)

    @gluon.jit
    def _act_view(act_s, buf):
        """Stage `buf` of the activation ring as the [16, 128] tile it holds."""
        return act_s.index(buf).reshape([_SLOTS, _COLS])

    @gluon.jit
    def _activation_operand(act):
        """A stage's [16, 128] activation rows -> the A operand, columns in the weights' order."""
        a = gl.permute(gl.reshape(act.load(_ACT_READ), [_SLOTS, 1, 4, 4, 8]), [0, 1, 3, 2, 4])
        a = gl.permute(gl.reshape(a, [_SLOTS, 16, 2, 4]), [0, 1, 3, 2])
        return gl.convert_layout(gl.reshape(a, [_SLOTS, _COLS]), _A, assert_trivial=True)

    @gluon.jit
    def _issue(step, buf, x_rows, x_used, gate_words, gate_fields, words, fields, F, act_s, gate_s, up_s,
               gate_f, up_f, WORDS: gl.constexpr):
        """cp.async of step `step` (activation columns, gate and up words and fields) into buffer `buf`."""
        cols = gl.arange(0, _COLS, layout=gl.SliceLayout(0, _ACT))
        async_copy.async_copy_global_to_shared(_act_view(act_s, buf), x_rows[:, None] + step * _COLS + cols[None, :],
                                               mask=x_used[:, None])
        w = gate_words + step * (32 * _BW)
        async_copy.async_copy_global_to_shared(gate_s.index(buf), words + w)
        async_copy.async_copy_global_to_shared(up_s.index(buf), words + F * WORDS + w)
        f = gate_fields + step * (32 * _BW // 4)
        async_copy.async_copy_global_to_shared(gate_f.index(buf), fields + f)
        async_copy.async_copy_global_to_shared(up_f.index(buf), fields + F * (WORDS // 4) + f)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_kernel(x, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                       BK: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr):
        """Grid (T k, F / 64): as _gate_up_kernel (x bf16 [T, l], h [HP, T k, F] bf16 parts), for T <= 16,
        F % 64 == 0 and l % 128 == 0, words stored in 32-row x 16-word blocks."""
        WORDS: gl.constexpr = L // 8
        STEPS: gl.constexpr = L // _COLS
        e, leader, slot_pair, used = _routing(ids, gl.program_id(0), T, K, TP, BK)
        if leader:
            row0 = gl.program_id(1) * _ROWS
            words = wgu + e * (2 * F) * WORDS
            fields = mgu + e * (2 * F) * (WORDS // 4)
            # Offsets of step 0 inside an expert's blocked words / fields (rows row0 .., see block_offsets).
            rw = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, _WORDS))
            cw = gl.arange(0, _BW, layout=gl.SliceLayout(0, _WORDS))
            gate_words = ((rw // 32) * (32 * WORDS) + (rw % 32) * _BW)[:, None] + cw[None, :]
            rf = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, _MULTS))
            cf = gl.arange(0, 4, layout=gl.SliceLayout(0, _MULTS))
            gate_fields = ((rf // 32) * (32 * WORDS // 4) + (rf % 32) * 4)[:, None] + cf[None, :]
            x_rows = x + (gl.convert_layout(slot_pair, gl.SliceLayout(1, _ACT)) // K).to(gl.int64) * L
            x_used = gl.convert_layout(used, gl.SliceLayout(1, _ACT))

            act_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * _SLOTS, _COLS // 2], _ACT_SHARED)
            gate_s = gl.allocate_shared_memory(gl.int32, [STAGES, _ROWS, _BW], _PLAIN)
            up_s = gl.allocate_shared_memory(gl.int32, [STAGES, _ROWS, _BW], _PLAIN)
            gate_f = gl.allocate_shared_memory(gl.uint8, [STAGES, _ROWS, 4], _PLAIN)
            up_f = gl.allocate_shared_memory(gl.uint8, [STAGES, _ROWS, 4], _PLAIN)
            for s in gl.static_range(STAGES - 1):
                _issue(s, s, x_rows, x_used, gate_words, gate_fields, words, fields, F, act_s, gate_s, up_s,
                       gate_f, up_f, WORDS)
                async_copy.commit_group()
            g = gl.zeros([_SLOTS, _ROWS], gl.float32, _MMA)
            u = gl.zeros([_SLOTS, _ROWS], gl.float32, _MMA)
            for i in range(STEPS):
                async_copy.wait_group(STAGES - 2)  # this thread's copies of step i have landed
                gl.thread_barrier()  # everyone's have, and everyone is done reading the buffer refilled next
                if i + STAGES - 1 < STEPS:
                    _issue(i + STAGES - 1, (i + STAGES - 1) % STAGES, x_rows, x_used, gate_words, gate_fields,
                           words, fields, F, act_s, gate_s, up_s, gate_f, up_f, WORDS)
                async_copy.commit_group()
                buf = i % STAGES
                xt = _activation_operand(_act_view(act_s, buf))
                g = mma_v2(xt, _weight_operand(gate_s.index(buf), gate_f.index(buf)), g)
                u = mma_v2(xt, _weight_operand(up_s.index(buf), up_f.index(buf)), u)
            rest = _situ_glu(g * _UNSHIFT, u * _UNSHIFT, beta1, beta2)
            pair = gl.convert_layout(slot_pair, gl.SliceLayout(1, _MMA))
            ok = gl.convert_layout(used, gl.SliceLayout(1, _MMA))
            rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(0, _MMA))
            for p in gl.static_range(HP):
                part = rest.to(gl.bfloat16)
                gl.store(h + (p * T * K + pair[:, None]) * F + rows[None, :], part,
                         mask=ok[:, None] & (rows < F)[None, :])
                rest = rest - part.to(gl.float32)


def serves(x: torch.Tensor, F: int, gate_up_tile: Tile) -> bool:
    """Whether `gate_up` computes this call: bf16 activations of at most 16 tokens on CUDA, the kernel's one
    tile shape (64 x 128, 2 warps; a register cap is the Triton kernel's: this one needs 144) and widths it
    divides."""
    T, L = x.shape
    return (gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and T <= SLOTS and F % ROWS == 0
            and L % COLS == 0 and block_words(L // 8) == BLOCK_WORDS
            and (gate_up_tile.rows, gate_up_tile.cols, gate_up_tile.warps) == (ROWS, COLS, WARPS))


def gate_up(x: torch.Tensor, ids: torch.Tensor, words: torch.Tensor, mults: torch.Tensor, h: torch.Tensor,
            beta1: float, beta2: float, stages: int) -> None:
    """h [parts, T k, F] <- the SiTU-GLU of the routed experts' gate and up rows for x [T, l] (`serves` must
    hold; words / mults: PreparedExperts.gate_up_*)."""
    T, L = x.shape
    K = ids.shape[1]
    F = words.shape[1] // 2
    require(stages >= 2, f"the Gluon gate/up pipeline needs >= 2 stages, got {stages}")
    gate_up_kernel[(T * K, F // ROWS)](x, ids, words, mults, h, T, K, F, beta1, beta2, L=L, TP=SLOTS,
                                       BK=next_pow2(K), HP=h.shape[0], STAGES=stages, num_warps=WARPS)
