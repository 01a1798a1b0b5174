"""The routed experts' gate|up and down in one launch (kernels/fused/routed_expert_fused_triton.py), interpreted:
bit for bit the two-launch routed kernels (same tiles, same math), against the reference, with padding rows,
and its counters back at zero after every launch (a CUDA graph replays it with nothing cleared in between).
float16 stands in for bf16 (the interpreter's bf16 tl.dot is broken). The interpreter runs programs in grid
order, so the tickets do too and every down tile's wait is met when it comes: the waits' device behaviour is
the GPU test's (test_routed_expert_layer.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import naive
from kernels.fused import routed_expert_fused_triton as fused
from kernels.fused import routed_expert_gemm_triton as routed
from tests.kernels.test_routed_expert_gemm import SKIP, E, K, L, _inputs, _padded


def _two_launches(z, w13, w2, indices, padding=None, **tiling):
    act, position = routed.routed_expert_gate_up_glu(z, w13, indices, "situ", 4.0, 25.0, padding=padding, **tiling)
    return routed.routed_expert_down(act, w2, indices, padding=padding, **tiling), position


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("tokens", "block_t"), [(5, 16), (20, 16), (20, 32)])
def test_one_launch_equals_the_two_launches(interpreted, tma, tokens, block_t):
    """20 tokens with 16-row tiles: expert 0 takes two passes in both projections; expert 3 has no rows (its down
    tiles do not wait). Twice on the same counters: same rows, counters zero after each launch."""
    z, w13, w2, indices = _inputs(tokens)
    tiling = {"block_n": 16, "block_t": block_t, "block_k": 32, "tma": tma}
    counters = naive.routed_counters(E, "cpu")
    want, want_position = _two_launches(z, w13, w2, indices, **tiling)
    for _ in range(2):
        got, position = fused.routed_expert_gate_up_down(z, w13, w2, indices, "situ", 4.0, 25.0, counters=counters,
                                                         **tiling)
        assert torch.equal(position, want_position) and torch.equal(got, want)
        assert not counters.any()
    ref, ref_position = naive.routed_expert_gate_up_down(z.float(), w13.float(), w2.float(), indices, "situ")
    assert torch.equal(position, ref_position)
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)


def test_wider_down_tiles(interpreted):
    """block_n_down 32 (half the down tiles, each waiting on its expert's 2 gate|up tiles of 16 columns): the two
    launches' rows with 32-wide down tiles, bit for bit; `prefetch` is compiled only (no change here)."""
    z, w13, w2, indices = _inputs(20)
    act, position = routed.routed_expert_gate_up_glu(z, w13, indices, "situ", block_n=16, block_k=32)
    want = routed.routed_expert_down(act, w2, indices, block_n=32, block_k=32)
    got, got_position = fused.routed_expert_gate_up_down(z, w13, w2, indices, "situ", block_n=16, block_k=32,
                                                         block_n_down=32, prefetch=True)
    assert torch.equal(got_position, position) and torch.equal(got, want)


@pytest.mark.parametrize(("real", "pad_at"), [(13, list(range(13, 20))), (9, [0, 4, 10])])
def test_padding_rows_as_the_two_launches(interpreted, real, pad_at):
    """With the padding marker: positions and real rows bit for bit the two launches', the padding pairs on row
    R = T*k, zeros; the real rows those of the real tokens alone."""
    (z, w13, w2, indices), marker, keep, (z_real, ind_real) = _padded(real, pad_at)
    tiling, padding = {"block_n": 16, "block_t": 16, "block_k": 32}, (marker, SKIP)
    want, want_position = _two_launches(z, w13, w2, indices, padding, **tiling)
    got, position = fused.routed_expert_gate_up_down(z, w13, w2, indices, "situ", 4.0, 25.0, padding=padding,
                                                     counters=naive.routed_counters(E, "cpu"), **tiling)
    rows, pairs = real * K, indices.numel()
    assert torch.equal(position, want_position) and (position[pad_at] == pairs).all()
    assert got.shape == (pairs + 1, L) and torch.equal(got[:rows], want[:rows]) and not got[pairs].any()
    alone, alone_position = fused.routed_expert_gate_up_down(z_real, w13, w2, ind_real, "situ", 4.0, 25.0, **tiling)
    assert torch.equal(position[keep], alone_position) and torch.equal(got[:rows], alone)


def test_launcher_refuses_bad_inputs():
    z, w13, w2, indices = _inputs(4)
    with pytest.raises(ValueError, match="indices"):
        fused.routed_expert_gate_up_down(z, w13, w2, indices[:3])
    with pytest.raises(ValueError, match="w2"):
        fused.routed_expert_gate_up_down(z, w13, w2[:, 1:], indices)
    with pytest.raises(ValueError, match="counters"):
        fused.routed_expert_gate_up_down(z, w13, w2, indices, counters=naive.routed_counters(E + 1, "cpu"))
    with pytest.raises(ValueError, match="padding marker"):
        fused.routed_expert_gate_up_down(z, w13, w2, indices, padding=(torch.zeros(3, dtype=torch.int64), 1))
