"""bench.moe_stream_floor's TMA form (Gluon, sm_90; GPU only): a persistent ring of bulk tensor copies.

Each program takes items p, p + P, ... (`moe_stream_floor.work_items`). An item's ITEM words are one TMA copy
of an [ITEM / 64, 64] int32 box (the words viewed as 256-byte rows) and its multipliers one [ITEM / 1024, 64]
box, both completing on the stage's mbarrier: two copy instructions per item instead of one 16-byte load per
thread and step. STAGES items are in flight per program; a stage is refilled once every warp has folded it
(one thread barrier), so the only per-byte work is the shared-memory read of the XOR fold that keeps the
copies live.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only where Gluon is absent
    gluon = None

ROW = 64  # int32 words of a descriptor row

if gluon is not None:
    _ROW = gl.constexpr(ROW)

    @gluon.jit
    def _issue(items, n_items, i, ok, gu_w, gu_m, d_w, d_m, words, mults, bar):
        """Start item i's two copies into one stage (nothing where not `ok`: past this program's items)."""
        j = gl.where(i < n_items, i, n_items - 1)
        down = gl.load(items + 2 * j) != 0
        chunk = gl.load(items + 2 * j + 1)
        w_rows: gl.constexpr = words.shape[0]
        m_rows: gl.constexpr = mults.shape[0]
        mbarrier.expect(bar, (w_rows + m_rows) * _ROW * 4, pred=ok)
        tma.async_copy_global_to_shared(gu_w, [chunk * w_rows, 0], bar, words, pred=ok and not down)
        tma.async_copy_global_to_shared(gu_m, [chunk * m_rows, 0], bar, mults, pred=ok and not down)
        tma.async_copy_global_to_shared(d_w, [chunk * w_rows, 0], bar, words, pred=ok and down)
        tma.async_copy_global_to_shared(d_m, [chunk * m_rows, 0], bar, mults, pred=ok and down)

    @gluon.jit
    def tma_stream_kernel(items, n_items, gu_w, gu_m, d_w, d_m, out, STAGES: gl.constexpr, WARPS: gl.constexpr):
        w_rows: gl.constexpr = gu_w.block_type.shape[0]
        m_rows: gl.constexpr = gu_m.block_type.shape[0]
        words = gl.allocate_shared_memory(gl.int32, [STAGES, w_rows, _ROW], gu_w.layout)
        mults = gl.allocate_shared_memory(gl.int32, [STAGES, m_rows, _ROW], gu_m.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        pid, programs = gl.program_id(0), gl.num_programs(0)
        mine = (n_items - pid + programs - 1) // programs
        for s in gl.static_range(STAGES):
            _issue(items, n_items, pid + s * programs, s < mine, gu_w, gu_m, d_w, d_m, words.index(s),
                   mults.index(s), bars.index(s))
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])
        acc = gl.zeros([w_rows, _ROW], gl.int32, layout)
        acc_m = gl.zeros([m_rows, _ROW], gl.int32, layout)
        for k in range(mine):
            stage = k % STAGES
            mbarrier.wait(bars.index(stage), (k // STAGES) & 1)
            acc ^= words.index(stage).load(layout)
            acc_m ^= mults.index(stage).load(layout)
            gl.thread_barrier()  # every warp has read the stage before its refill overwrites it
            _issue(items, n_items, pid + (k + STAGES) * programs, k + STAGES < mine, gu_w, gu_m, d_w, d_m,
                   words.index(stage), mults.index(stage), bars.index(stage))
        for t in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(t))
        gl.store(out + pid, gl.xor_sum(gl.xor_sum(acc, 1), 0) ^ gl.xor_sum(gl.xor_sum(acc_m, 1), 0))


def descriptors(tensors: tuple[torch.Tensor, ...], item: int) -> list:
    """TMA descriptors of (gate/up words, multipliers, down words, multipliers) as [n / 64, 64] int32 rows,
    boxes of one item."""
    if item % (16 * ROW):
        raise ValueError(f"a TMA item needs a multiple of {16 * ROW} words, got {item}")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    boxes = (item // ROW, item // 16 // ROW) * 2
    return [TensorDescriptor.from_tensor(t.reshape(-1, ROW), [rows, ROW], layout)
            for t, rows in zip(tensors, boxes, strict=True)]


def tma_launcher(items: torch.Tensor, tensors: tuple[torch.Tensor, ...], out: torch.Tensor, item: int,
                 stages: int, warps: int):
    """A call that folds `items` with out.numel() persistent programs (moe_stream_floor.launcher's contract)."""
    descs = descriptors(tensors, item)

    def call() -> torch.Tensor:
        tma_stream_kernel[(out.numel(),)](items, items.shape[0], *descs, out, STAGES=stages, WARPS=warps,
                                          num_warps=warps)
        return out
    return call
