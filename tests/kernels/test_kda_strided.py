"""KDA decode kernels on strided pool views: one launch over all heads of a head-interleaved page buffer.

Oracles: the reference (kernels.kda.naive) on dense copies of the same states, and the per-head launches
the fast path used before (one [slots, 1, D, D] view per head). Every byte of the buffer that no addressed
slot owns (other slots, page padding) must come out unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.kda import decode_step_triton, decode_triton, naive
from tests.kernels.kda_inputs import KdaCase

CASE = KdaCase()
PAD = 5  # elements of padding after each head's segment and at the end of each page


@dataclass
class PagedPools:
    """A flat float32 buffer of pages [head][state D*D | conv 3*D*(W-1) | pad] + pad, and views on it."""

    buffer: torch.Tensor
    state: torch.Tensor  # [pages, H, D, D]
    conv: torch.Tensor  # [pages, 3, H, D, W-1]

    @classmethod
    def build(cls, gen: torch.Generator, transposed: bool = False) -> PagedPools:
        """transposed: each head's state stored column-major and each conv window tap-major (unit strides
        elsewhere than the last dim: the kernels must use every stride they are given)."""
        h, d, w, pages = CASE.heads, CASE.dim, CASE.width, CASE.num_slots
        window = d * (w - 1)
        head = d * d + 3 * window + PAD
        page = h * head + PAD
        buffer = torch.randn(pages * page, generator=gen) * 0.1
        state_inner = (1, d) if transposed else (d, 1)
        conv_inner = (1, d) if transposed else (w - 1, 1)
        state = buffer.as_strided((pages, h, d, d), (page, head, *state_inner), 0)
        conv = buffer.as_strided((pages, 3, h, d, w - 1), (page, window, head, *conv_inner), d * d)
        return cls(buffer, state, conv)

    def head_views(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast path's former per-head views: [pages, 1, D, D] and [pages, 3, 1, D, W-1]."""
        return self.state[:, head : head + 1], self.conv[:, :, head : head + 1]


def _head_params(params: tuple[torch.Tensor, ...], head: int) -> tuple[torch.Tensor, ...]:
    conv_w, a_log, dt_bias, norm_w = params
    d = CASE.dim
    return (conv_w[:, head * d : (head + 1) * d].contiguous(), a_log[head : head + 1].contiguous(),
            dt_bias[head * d : (head + 1) * d].contiguous(), norm_w)


def _outside(pools: PagedPools, slots: list[int]) -> torch.Tensor:
    """Mask of the buffer elements that no addressed slot's state or conv view covers."""
    marker = torch.zeros_like(pools.buffer)
    state = marker.as_strided(pools.state.shape, pools.state.stride(), pools.state.storage_offset())
    conv = marker.as_strided(pools.conv.shape, pools.conv.stride(), pools.conv.storage_offset())
    state[slots] = 1.0
    conv[slots] = 1.0
    return marker == 0


@pytest.mark.parametrize(("transposed", "lower_bound", "tuning"),
                         [(False, -5.0, {}), (True, None, {}), (True, -5.0, {"block_v": 4})])
def test_one_strided_launch_equals_reference_and_per_head_launches(interpreted, transposed, lower_bound, tuning):
    """block_v=4: each head's value columns split over 4 programs (the last to arrive normalises)."""
    gen = torch.Generator().manual_seed(11)
    pools = PagedPools.build(gen, transposed)
    params = CASE.params(gen)
    x = [t[:, 0] for t in CASE.tokens(gen, 3, 1)]
    slots = torch.tensor([4, 0, 6])
    before = pools.buffer.clone()
    dense = (pools.state.contiguous(), pools.conv.contiguous())
    per_head = PagedPools.build(torch.Generator().manual_seed(0), transposed)
    per_head.buffer.copy_(before)

    y = decode_step_triton.kda_decode_step(*x, *params, pools.state, pools.conv, slots, lower_bound=lower_bound,
                                           **tuning)

    y_ref = naive.kda_decode_step(*x, *params, *dense, slots, lower_bound=lower_bound)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools.state, dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools.conv, dense[1], rtol=0, atol=0)
    outside = _outside(pools, slots.tolist())
    assert outside.sum() > 0 and torch.equal(pools.buffer[outside], before[outside])

    heads = [decode_step_triton.kda_decode_step(*(t[:, h : h + 1] for t in x), *_head_params(params, h),
                                                *per_head.head_views(h), slots, lower_bound=lower_bound)
             for h in range(CASE.heads)]
    torch.testing.assert_close(y, torch.cat(heads, dim=1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools.buffer, per_head.buffer, rtol=1e-6, atol=1e-7)


def test_reference_writes_through_strided_views():
    """The CPU path (naive) takes the same views and updates the buffer itself, nothing outside the slots."""
    gen = torch.Generator().manual_seed(12)
    pools = PagedPools.build(gen)
    params = CASE.params(gen)
    x = [t[:, 0] for t in CASE.tokens(gen, 2, 1)]
    slots = torch.tensor([5, 2])
    before = pools.buffer.clone()
    dense = (pools.state.contiguous(), pools.conv.contiguous())
    y = naive.kda_decode_step(*x, *params, pools.state, pools.conv, slots)
    y_dense = naive.kda_decode_step(*x, *params, *dense, slots)
    assert torch.equal(y, y_dense)
    assert torch.equal(pools.state, dense[0]) and torch.equal(pools.conv, dense[1])
    assert not torch.equal(pools.buffer, before)
    outside = _outside(pools, slots.tolist())
    assert torch.equal(pools.buffer[outside], before[outside])


def test_verify_recurrence_on_strided_views(interpreted):
    """The replay/verify kernel shares the addressing: replay + partial commit on the paged views."""
    gen = torch.Generator().manual_seed(13)
    pools = PagedPools.build(gen)
    params = CASE.params(gen)
    slots = torch.tensor([1, 3])
    replay = (*CASE.tokens(gen, 2, 2)[:5], torch.tensor([2, 1]))
    x = CASE.tokens(gen, 2, 3)
    before = pools.buffer.clone()
    dense = (pools.state.contiguous(), pools.conv.contiguous())
    y = decode_triton.fused_kda_recurrent(*x, *params, pools.state, pools.conv, slots, replay=replay,
                                          n_commit=2)
    y_ref = naive.fused_kda_recurrent(*x, *params, *dense, slots, replay=replay, n_commit=2)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools.state, dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools.conv, dense[1], rtol=0, atol=0)
    outside = _outside(pools, slots.tolist())
    assert torch.equal(pools.buffer[outside], before[outside])


@pytest.mark.parametrize("tuning", [{}, {"block_v": 8}])
def test_row_strided_inputs_need_no_copy(interpreted, tuning):
    """q, k, v, z, gate, beta as column slices of one projection output (row stride > H*D): the step reads
    them in place and gives exactly the contiguous launch's result (also with split value columns)."""
    gen = torch.Generator().manual_seed(14)
    params = CASE.params(gen)
    pools = CASE.pools(gen)
    dense_pools = tuple(p.clone() for p in pools)
    b, h, d = 3, CASE.heads, CASE.dim
    wide = torch.randn(b, 5 * h * d + h + 3, generator=gen)  # + 3: a row stride that is no multiple of D
    x = [wide[:, i * h * d : (i + 1) * h * d].view(b, h, d) for i in range(5)]
    beta = wide[:, 5 * h * d : 5 * h * d + h]
    q, k, v, z, gate = x
    assert all(decode_step_triton._dense_rows(t) is t for t in (*x, beta))  # no copy is made
    slots = torch.tensor([2, 6, 3])
    y = decode_step_triton.kda_decode_step(q, k, v, z, beta, gate, *params, *pools, slots, **tuning)
    y_dense = decode_step_triton.kda_decode_step(*(t.contiguous() for t in (q, k, v, z, beta, gate)), *params,
                                                 *dense_pools, slots, **tuning)
    assert torch.equal(y, y_dense)
    assert torch.equal(pools[0], dense_pools[0]) and torch.equal(pools[1], dense_pools[1])
