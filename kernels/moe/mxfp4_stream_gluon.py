"""Gluon building blocks of the latent-MoE decode kernels (kernels.moe.decode_gluon): layouts, routing, and a
cp.async ring of MXFP4 weight tiles and activation rows read into tensor-core operands.

A program streams `rows` weight rows (blocked storage: 32-row x 16-word blocks, `mxfp4_tile_triton.prepare`)
128 columns a step against the 16 token slots of its expert. The register layouts are the ones Triton derives
for `mxfp4_tile_triton.mxfp4_tile` and `lane_group_columns` (written out here, for any rows and warps: the
weight rows are the MMA's N side, 8 per warp and instruction), so every reshape after a shared-memory read is
free; the conversions to the operand layouts are asserted trivial at compile time. What Gluon adds over the
Triton kernels (docs/kernels.md, history 28 and 32): the activation tile is staged as [32, 64] half rows
with 16-byte chunks XOR-swizzled by half row and read through a [16, 128] view, without bank conflicts
(asserted at compile time with `gl.bank_conflicts` for the reads and the copies; Triton's unswizzled staging
has 4x the wavefronts), and the ring is refilled right after one barrier per step, before the step's
shared-memory reads.
"""

from __future__ import annotations

from kernels.moe.mxfp4_tile_triton import _FIELD_TO_BF16X2, BLOCK_ROWS, SHIFT, _decode_asm

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernels serve every caller
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - exercised only where Gluon is absent
    gluon = None

COLS, SLOTS, BLOCK_WORDS = 128, 16, 16  # columns a step, token slots, words a row of a stored block

if gluon is not None:
    _COLS, _SLOTS, _BW, _BLOCK_ROWS = (gl.constexpr(v) for v in (COLS, SLOTS, BLOCK_WORDS, BLOCK_ROWS))
    _DECODE = gl.constexpr(_decode_asm())
    _FIELDS = gl.constexpr(_FIELD_TO_BF16X2)
    UNSHIFT = gl.constexpr(2.0**SHIFT)
    _PLAIN = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    _ACT_SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))

    @gluon.constexpr_function
    def small_layout(warps):
        """Routing bookkeeping on [16, 16] tiles (tokens x slots)."""
        return gl.BlockedLayout([1, 1], [4, 8], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _act_copy_layout(warps):
        """Copies of [16, 128] activation rows: 8 columns (16 bytes) a thread."""
        return gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def mma_layout(warps):
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _words_layout(warps):
        """Copies and reads of a [rows, 16] word tile: 4 words (16 bytes) a thread, 8 rows a warp."""
        return gl.BlockedLayout([1, 4], [8, 4], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _fields_copy_layout(warps):
        """Copies of a [rows, 4] multiplier tile: one row's 4 bytes a thread."""
        return gl.BlockedLayout([1, 4], [32, 1], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _fields_layout(rows, warps):
        """[rows, group, word of the group]: the decode's multipliers (rows as the words' after `_lane_groups`)."""
        row_bits = [[1 << b, 0, 0] for b in range(2 + warps.bit_length(), rows.bit_length() - 1)]
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2]] + row_bits, lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[8 << b, 0, 0] for b in range(warps.bit_length() - 1)], block_bases=[], shape=[rows, 4, 4])

    @gluon.constexpr_function
    def _act_read_layout(warps):
        """The [16, 128] activation operand before its column permutation: 8 columns a thread, every warp all
        16 rows."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 4], [0, 1], [0, 2], [8, 0], [0, 8], [0, 16]],
            lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0]] * (warps.bit_length() - 1),
            block_bases=[], shape=[SLOTS, COLS])

    @gluon.jit
    def expert_tokens(ids, pair, T, K, TP: gl.constexpr, BK: gl.constexpr, WARPS: gl.constexpr):
        """expert_slots_triton.expert_tokens: the pair's expert, whether the pair leads it, per token the
        first of its pairs naming the expert (1 << 30 where none), the match mask and flat indices."""
        e = gl.load(ids + pair)
        tok = gl.arange(0, TP, layout=gl.SliceLayout(1, small_layout(WARPS)))
        slot = gl.arange(0, BK, layout=gl.SliceLayout(0, small_layout(WARPS)))
        index = tok[:, None] * K + slot[None, :]
        match = gl.load(ids + index, mask=(tok[:, None] < T) & (slot[None, :] < K), other=-1) == e
        first = gl.min(gl.where(match, index, 1 << 30), 1)
        return e.to(gl.int64), gl.min(first, 0) == pair, first, match, index

    @gluon.jit
    def slots(first, WARPS: gl.constexpr):
        """expert_slots_triton.slots for one pass of 16 slots (T <= 16): [slot, token] one-hot map, each slot's
        first pair and whether it is used (slots in token order)."""
        tok = gl.arange(0, _SLOTS, layout=gl.SliceLayout(1, small_layout(WARPS)))
        later = gl.arange(0, _SLOTS, layout=gl.SliceLayout(0, small_layout(WARPS)))
        routed = (first < (1 << 30)).to(gl.int32)
        # Slot of token t: the routed tokens before it ([t', t] tiles, reduced over t').
        rank = gl.sum(gl.where(tok[:, None] < later[None, :], routed[:, None], 0), 0)
        first_t = gl.convert_layout(first, gl.SliceLayout(0, small_layout(WARPS)))
        hit = (rank[None, :] == tok[:, None]) & (first_t < (1 << 30))[None, :]
        return hit, gl.sum(gl.where(hit, first_t[None, :], 0), 1), gl.sum(hit.to(gl.int32), 1) > 0

    @gluon.jit
    def act_rows(base, slot_pair, used, K, WIDTH, WARPS: gl.constexpr):
        """Row pointers (row slot_pair // K of a [., WIDTH] matrix at `base`; K = 1: row slot_pair) and masks
        in the activation copies' layout."""
        layout: gl.constexpr = gl.SliceLayout(1, _act_copy_layout(WARPS))
        rows = gl.convert_layout(slot_pair, layout) // K
        return base + rows.to(gl.int64) * WIDTH, gl.convert_layout(used, layout)

    @gluon.jit
    def block_tile(row0, WORDS: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
        """Offsets of step 0's [ROWS, 16] words and [ROWS, 4] multiplier fields of rows row0 .. inside a matrix
        of WORDS-word rows in blocked storage (mxfp4_tile_triton.block_offsets); step s adds s * `STEP_WORDS`
        and s * `STEP_FIELDS`."""
        rw = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, _words_layout(WARPS)))
        cw = gl.arange(0, _BW, layout=gl.SliceLayout(0, _words_layout(WARPS)))
        words = ((rw // _BLOCK_ROWS) * (_BLOCK_ROWS * WORDS) + (rw % _BLOCK_ROWS) * _BW)[:, None] + cw[None, :]
        rf = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, _fields_copy_layout(WARPS)))
        cf = gl.arange(0, 4, layout=gl.SliceLayout(0, _fields_copy_layout(WARPS)))
        fields = ((rf // _BLOCK_ROWS) * (_BLOCK_ROWS * WORDS // 4) + (rf % _BLOCK_ROWS) * 4)[:, None] + cf[None, :]
        return words, fields

    STEP_WORDS = gl.constexpr(BLOCK_ROWS * BLOCK_WORDS)
    STEP_FIELDS = gl.constexpr(BLOCK_ROWS * BLOCK_WORDS // 4)

    @gluon.jit
    def act_ring(STAGES: gl.constexpr):
        return gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * _SLOTS, _COLS // 2], _ACT_SHARED)

    @gluon.jit
    def words_ring(STAGES: gl.constexpr, ROWS: gl.constexpr):
        return gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, _BW], _PLAIN)

    @gluon.jit
    def fields_ring(STAGES: gl.constexpr, ROWS: gl.constexpr):
        return gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 4], _PLAIN)

    @gluon.jit
    def _act_view(ring, buf):
        """Stage `buf` of an activation ring as the [16, 128] tile it holds."""
        return ring.index(buf).reshape([_SLOTS, _COLS])

    @gluon.jit
    def copy_act(ring, buf, rows, used, col0, WARPS: gl.constexpr):
        """cp.async of columns col0 .. col0 + 128 of the slots' rows (`act_rows`) into stage `buf`."""
        cols = gl.arange(0, _COLS, layout=gl.SliceLayout(0, _act_copy_layout(WARPS)))
        view = _act_view(ring, buf)
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.bfloat16, [_SLOTS, _COLS], _act_copy_layout(WARPS)),
                                           view.type) == 0)
        async_copy.async_copy_global_to_shared(view, rows[:, None] + col0 + cols[None, :], mask=used[:, None])

    @gluon.jit
    def copy_tile(words_s, fields_s, buf, words, fields, step):
        """cp.async of a step's words and multiplier fields (`words` / `fields`: step 0's pointers) into `buf`."""
        async_copy.async_copy_global_to_shared(words_s.index(buf), words + step * STEP_WORDS)
        async_copy.async_copy_global_to_shared(fields_s.index(buf), fields + step * STEP_FIELDS)

    @gluon.jit
    def _lane_groups(t):
        """[R, 4, 4] (group, word of the group) -> [R, 16] in mxfp4_tile_triton._lane_groups' order."""
        t = gl.permute(gl.reshape(t, [t.shape[0], 1, 4, 4]), [0, 1, 3, 2])
        return gl.reshape(t, [t.shape[0], 16])

    @gluon.jit
    def weight_operand(words_s, fields_s, buf, WARPS: gl.constexpr):
        """Stage `buf`'s [R, 16] words and [R, 4] fields -> the bf16 [128, R] B operand (weights x 2^-SHIFT,
        columns in mxfp4_tile_triton's order)."""
        ROWS: gl.constexpr = words_s.shape[1]
        w = words_s.index(buf).load(_words_layout(WARPS)).to(gl.uint32, bitcast=True)
        w = _lane_groups(gl.reshape(w, [ROWS, 4, 4]))
        f = fields_s.index(buf).load(gl.SliceLayout(2, _fields_layout(ROWS, WARPS))).to(gl.uint32) * _FIELDS
        m = _lane_groups(f[:, :, None] + gl.full([ROWS, 4, 4], 0, gl.uint32, _fields_layout(ROWS, WARPS)))
        m = gl.convert_layout(m, w.type.layout, assert_trivial=True)
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        low = gl.join(gl.join(e0, e2), gl.join(e1, e3))
        high = gl.join(gl.join(e4, e6), gl.join(e5, e7))
        tile = gl.permute(gl.reshape(gl.join(low, high), [ROWS, _COLS]), [1, 0])
        return gl.convert_layout(tile, gl.DotOperandLayout(1, mma_layout(WARPS), 8), assert_trivial=True)

    @gluon.jit
    def act_operand(ring, buf, WARPS: gl.constexpr):
        """Stage `buf`'s [16, 128] activation rows -> the A operand, columns in the weights' order."""
        view = _act_view(ring, buf)
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.bfloat16, [_SLOTS, _COLS], _act_read_layout(WARPS)),
                                           view.type) == 0)
        a = view.load(_act_read_layout(WARPS))
        a = gl.permute(gl.reshape(a, [_SLOTS, 1, 4, 4, 8]), [0, 1, 3, 2, 4])
        a = gl.permute(gl.reshape(a, [_SLOTS, 16, 2, 4]), [0, 1, 3, 2])
        return gl.convert_layout(gl.reshape(a, [_SLOTS, _COLS]), gl.DotOperandLayout(0, mma_layout(WARPS), 8),
                                 assert_trivial=True)
