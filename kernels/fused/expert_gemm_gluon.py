"""The dense experts' GEMMs of a decode step (kernels/fused/expert_gemm_triton.py's contract) in Gluon for the
H200: persistent programs streaming weight tiles through a TMA ring into async wgmma (GPU only: Gluon has no
CPU interpreter; the Triton forms serve every other call).

Why another form: the Triton TMA kernels run at 73-80 % of copy at 64 token rows and their rate falls with
the rows per tile (docs/serving.md item 11). Their grid is one program per (expert, 64 columns): at 64 rows
the two float32 accumulators hold a program to ~2 an SM, so 384 gate|up programs run as 1.5 waves, each
program ramping its own pipeline. Here one program per SM walks its tiles (expert, columns) in turn through
one ring of STAGES (weights, tokens) K steps that runs on across tile boundaries, so a tile's GLU and stores
overlap the next tile's loads and the only ramp is the kernel's.
Swap-AB as the Triton form: a tile's weight rows are the wgmma's M side (64 rows, one warpgroup), the tokens
its N side (16-64). Each tile holds two 64-row weight blocks against the same token tile: the gate rows and
the up rows F below (GLU in the epilogue), or, for the down projection, two adjacent 64-row blocks (128
output columns a tile, the tokens read once for both).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, sm_count

try:  # Gluon ships with Triton >= 3.5 (the device's 3.6); without it the Triton forms serve every call
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only where Gluon is absent
    gluon = None

ROWS, BLOCK_K, WARPS, MAX_TOKENS = 64, 64, 4, 64  # weight rows a block (one warpgroup's M), K a step
SHARED_BYTES = 232448  # the H200's shared memory a block (227 KiB)
MAX_STAGES = 8

if gluon is not None:
    _ROWS, _WARPS = gl.constexpr(ROWS), gl.constexpr(WARPS)

    @gluon.jit
    def _sigmoid(v):
        return 1.0 / (1.0 + gl.exp(-v))

    @gluon.jit
    def _glu(g, u, beta1, beta2, SITU: gl.constexpr):
        """expert_gemm_triton's GLU (situ_glu_triton.glu_values) of float32 gate and up values."""
        if SITU:
            gate = beta1 * (2 * _sigmoid(2 * g / beta1) - 1) * _sigmoid(g)
            return gate * (beta2 * (2 * _sigmoid(2 * u / beta2) - 1))
        return g * _sigmoid(g) * u

    @gluon.jit
    def _issue(step, x_desc, w_desc, x_s, a_s, b_s, ready, first, nprog, tiles_per_expert, x_rows_per_expert,
               w_rows_per_expert, second, KSTEPS: gl.constexpr, COLS: gl.constexpr, STAGES: gl.constexpr,
               BOXES: gl.constexpr, RESIDENT: gl.constexpr):
        """TMA copies of this program's K step `step` (tile first + (step // KSTEPS) * nprog: BOXES 64-wide K
        boxes of both weight blocks, and of the tokens unless RESIDENT) into its stage."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        tile = first + (step // KSTEPS) * nprog
        expert = tile // tiles_per_expert
        w_row = expert * w_rows_per_expert + (tile % tiles_per_expert) * COLS
        s = step % STAGES
        bar = ready.index(s)
        x_bytes: gl.constexpr = 0 if RESIDENT else x_desc.block_type.nbytes
        mbarrier.expect(bar, BOXES * (x_bytes + 2 * w_desc.block_type.nbytes))
        for b in gl.static_range(BOXES):
            k = ((step % KSTEPS) * BOXES + b) * BK
            if not RESIDENT:
                tma.async_copy_global_to_shared(x_desc, [expert * x_rows_per_expert, k], bar, x_s.index(s * BOXES + b))
            tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, a_s.index(s * BOXES + b))
            tma.async_copy_global_to_shared(w_desc, [w_row + second, k], bar, b_s.index(s * BOXES + b))

    @gluon.jit
    def _store(values, out, expert, col0, T, width, stride_oe, stride_ot, BT: gl.constexpr):
        """values [ROWS, BT] (output columns x tokens) -> out[expert, t, col0 + r], in rows-fastest order."""
        layout: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])
        v = gl.convert_layout(values, layout)
        cols = col0 + gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, layout))
        tokens = gl.arange(0, BT, layout=gl.SliceLayout(0, layout))
        target = out + expert.to(gl.int64) * stride_oe + tokens.to(gl.int64)[None, :] * stride_ot + cols[:, None]
        gl.store(target, v.to(out.dtype.element_ty), mask=(cols < width)[:, None] & (tokens < T)[None, :])

    @gluon.jit
    def _expert_gemm_kernel(x_desc, w_desc, out, T, width, tiles, tiles_per_expert, x_rows_per_expert,
                            w_rows_per_expert, second, stride_oe, stride_ot, beta1, beta2, K: gl.constexpr,
                            ACT: gl.constexpr, STAGES: gl.constexpr, BOXES: gl.constexpr, RESIDENT: gl.constexpr,
                            READ_ONLY: gl.constexpr):
        """x [E*x_rows_per_expert or T, K] and w [E*w_rows_per_expert, K] (2-D TMA views) -> out [E, T, width].
        Tile = (expert, COLS output columns): weight blocks at rows n0 and n0 + second of the expert. ACT 1
        SiTU / 2 SwiGLU: GLU of the two blocks (second = F, COLS 64); ACT 0: both stored (second = COLS / 2).
        A step = BOXES 64-wide K boxes (contiguous 128 * BOXES bytes of each weight row). RESIDENT (x shared by
        every expert): the token tile is read once into shared memory, the ring holds weights only. READ_ONLY: the
        loads alone, no MMA and no output (bench.serve_glue's floor of this read order)."""
        BT: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        KBOXES: gl.constexpr = K // BK
        KSTEPS: gl.constexpr = KBOXES // BOXES
        COLS: gl.constexpr = _ROWS if ACT != 0 else 2 * _ROWS
        first = gl.program_id(0)
        nprog = gl.num_programs(0)
        total = (tiles - first + nprog - 1) // nprog * KSTEPS  # this program's K steps over all its tiles

        x_s = gl.allocate_shared_memory(x_desc.dtype, [KBOXES if RESIDENT else STAGES * BOXES, BT, BK], x_desc.layout)
        a_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES * BOXES, _ROWS, BK], w_desc.layout)
        b_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES * BOXES, _ROWS, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())  # + the tokens'
        for i in gl.static_range(STAGES + 1):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        if RESIDENT:
            mbarrier.expect(ready.index(STAGES), KBOXES * x_desc.block_type.nbytes)
            for i in gl.static_range(KBOXES):
                tma.async_copy_global_to_shared(x_desc, [0, i * BK], ready.index(STAGES), x_s.index(i))
        for i in gl.static_range(STAGES - 1):
            if i < total:
                _issue(i, x_desc, w_desc, x_s, a_s, b_s, ready, first, nprog, tiles_per_expert, x_rows_per_expert,
                       w_rows_per_expert, second, KSTEPS, COLS, STAGES, BOXES, RESIDENT)
        if RESIDENT:
            mbarrier.wait(ready.index(STAGES), 0)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_WARPS, 1],
                                                      instr_shape=[16, BT, 16])
        g = gl.zeros([_ROWS, BT], gl.float32, mma)
        u = gl.zeros([_ROWS, BT], gl.float32, mma)
        for step in range(total):
            s = step % STAGES
            k = step % KSTEPS
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            if not READ_ONLY:
                for b in gl.static_range(BOXES):
                    if RESIDENT:
                        xt = x_s.index(k * BOXES + b).permute((1, 0))  # [BK, BT]: the tokens on the MMA's N side
                    else:
                        xt = x_s.index(s * BOXES + b).permute((1, 0))
                    if b == 0:
                        g = warpgroup_mma(a_s.index(s * BOXES), xt, g, use_acc=k > 0, is_async=True)
                        u = warpgroup_mma(b_s.index(s * BOXES), xt, u, use_acc=k > 0, is_async=True)
                    else:
                        g = warpgroup_mma(a_s.index(s * BOXES + b), xt, g, is_async=True)
                        u = warpgroup_mma(b_s.index(s * BOXES + b), xt, u, is_async=True)
                # This step's MMAs may still run; the previous step's are done, so its stage can be refilled (after
                # every warp's wait: each warp's share of an MMA reads the stage).
                g, u = warpgroup_mma_wait(num_outstanding=2 * BOXES, deps=(g, u))
            gl.thread_barrier()
            nxt = step + STAGES - 1
            if nxt < total:
                _issue(nxt, x_desc, w_desc, x_s, a_s, b_s, ready, first, nprog, tiles_per_expert,
                       x_rows_per_expert, w_rows_per_expert, second, KSTEPS, COLS, STAGES, BOXES, RESIDENT)
            if not READ_ONLY:
                if k == KSTEPS - 1:  # the tile's last step: its epilogue runs while the ring keeps loading
                    g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
                    tile = first + (step // KSTEPS) * nprog
                    expert = tile // tiles_per_expert
                    col0 = (tile % tiles_per_expert) * COLS
                    if ACT != 0:
                        _store(_glu(g, u, beta1, beta2, ACT == 1), out, expert, col0, T, width, stride_oe, stride_ot, BT)
                    else:
                        _store(g, out, expert, col0, T, width, stride_oe, stride_ot, BT)
                        _store(u, out, expert, col0 + _ROWS, T, width, stride_oe, stride_ot, BT)
        for i in gl.static_range(STAGES + 1):
            mbarrier.invalidate(ready.index(i))


def _token_block(tokens: int) -> int:
    return max(16, next_pow2(tokens))


def stages(tokens: int, depth: int, boxes: int = 1, resident: bool = False) -> int:
    """Ring depth: as many stages (boxes x (2 weight blocks + the token tile unless resident)) as fit beside the
    resident tokens and the epilogue's layout change."""
    block_t = _token_block(tokens)
    stage = boxes * (2 * ROWS + (0 if resident else block_t)) * BLOCK_K * 2
    fixed = ROWS * block_t * 4 + 1024 + (block_t * depth * 2 if resident else 0)  # convert_layout tile, barriers
    return min(MAX_STAGES, (SHARED_BYTES - fixed) // stage)


def shape_rules(x: torch.Tensor, w: torch.Tensor, tokens: int, width: int, glu: bool) -> bool:
    """`serves` but the device: bf16 operands (the served dtype), 1-64 tokens, K a multiple of 64 and `width`
    of the tiles' output columns (64 with a GLU, 128 without), one contiguous stack of experts' weights, token
    rows TMA can read (unit-strided, 16-byte row stride and base)."""
    depth = x.shape[-1]
    return (x.dtype == w.dtype == torch.bfloat16 and 1 <= tokens <= MAX_TOKENS and depth % BLOCK_K == 0
            and width % (ROWS if glu else 2 * ROWS) == 0 and w.is_contiguous() and x.stride(-1) == 1
            and (x.stride(-2) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
            and (x.dim() == 2 or x.is_contiguous()))


def serves(x: torch.Tensor, w: torch.Tensor, tokens: int, width: int, glu: bool) -> bool:
    """Whether the Gluon form computes this call: on CUDA with Gluon present, and `shape_rules`."""
    return gluon is not None and x.is_cuda and shape_rules(x, w, tokens, width, glu)


def _layout(x: torch.Tensor):
    """128-byte swizzled tiles of 64 16-bit columns (what TMA writes and wgmma reads without conflicts)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 * x.element_size(), rank=2)


def expert_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, act: int, beta1: float, beta2: float,
                ring: int | None = None, boxes: int = 1, resident: bool = False, per_sm: int = 1) -> torch.Tensor:
    """x [T, K] shared by every expert, or [E, T, K]; w [E, rows, K] -> out [E, T, width] (`serves` must hold).
    act 0: the plain GEMM (width = rows); 1 SiTU / 2 SwiGLU: the GLU of gate rows and the up rows `width`
    below them (rows = 2 width). ring: the stages of the TMA ring (default: the most that fit, `stages`); boxes:
    64-wide K boxes a stage; resident: x [T, K] read into shared memory once (shared x only); per_sm: programs
    an SM (more than 1 needs a ring small enough for them to share its shared memory)."""
    require(serves(x, w, out.shape[1], out.shape[2], act != 0),
            "the Gluon expert GEMM does not take this call (see serves)")
    return launch(x, w, out, act, beta1, beta2, ring, boxes, resident, per_sm)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, act: int, beta1: float, beta2: float,
           ring: int | None = None, boxes: int = 1, resident: bool = False, per_sm: int = 1,
           read_only: bool = False) -> torch.Tensor:
    """`expert_gemm` without `serves`' device check (tests/kernels/test_sm90_compile.py records it on CPU);
    `read_only`: the kernel's loads alone, `out` left as it was (bench.serve_glue's read floor)."""
    experts, tokens, width = out.shape
    depth = x.shape[-1]
    block_t = _token_block(tokens)
    require(depth % (BLOCK_K * boxes) == 0, f"{boxes} boxes a step must divide K = {depth} in 64-wide boxes")
    require(not resident or x.dim() == 2, "resident tokens need x shared by every expert ([T, K])")
    ring = ring or stages(tokens, depth, boxes, resident)
    require(ring >= 2, f"the TMA ring needs >= 2 stages, got {ring}")
    x2 = x if x.dim() == 2 else x.view(experts * tokens, depth)
    w2 = w.view(experts * w.shape[1], depth)
    layout = _layout(x)
    x_desc = TensorDescriptor.from_tensor(x2, [block_t, BLOCK_K], layout)
    w_desc = TensorDescriptor.from_tensor(w2, [ROWS, BLOCK_K], layout)
    cols = ROWS if act != 0 else 2 * ROWS
    tiles_per_expert = width // cols
    tiles = experts * tiles_per_expert
    grid = (min(tiles, per_sm * sm_count(x.device, cpu=132)),)
    _expert_gemm_kernel[grid](x_desc, w_desc, out, tokens, width, tiles, tiles_per_expert,
                              0 if x.dim() == 2 else tokens, w.shape[1], width if act != 0 else ROWS,
                              out.stride(0), out.stride(1), float(beta1), float(beta2), K=depth, ACT=act,
                              STAGES=ring, BOXES=boxes, RESIDENT=resident, READ_ONLY=read_only,
                              num_warps=WARPS)
    return out
