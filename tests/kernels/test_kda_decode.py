"""KDA decode step and replay verify: reference vs float64 math, Triton (interpreted) vs reference."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.kda import decode_step_triton, decode_triton, naive
from kernels.kda.verify_triton import kda_verify_replay
from tests.kernels.kda_inputs import KdaCase

CASE = KdaCase()


def _float64_step(x, conv, state, params, lower_bound):
    """One token of one sequence written out in float64 from eq.1-6 (independent of k3core.ops)."""
    q, k, v, z, beta, gate = (t.double() for t in x)
    conv_w, A_log, dt_bias, norm_w = (p.double() for p in params)
    H, D = q.shape
    streams = []
    for c, raw in enumerate((q, k, v)):
        window = torch.cat([conv[c].double(), raw.reshape(H, D, 1)], dim=-1)  # [H, D, W]
        y = (window * conv_w[c].reshape(H, D, -1)).sum(-1)
        streams.append(y * torch.sigmoid(y))
    qc, kc, vc = streams
    qc = qc / torch.sqrt((qc * qc).sum(-1, keepdim=True) + 1e-6)
    kc = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + 1e-6)
    zz = A_log.exp()[:, None] * (z + dt_bias.reshape(H, D))
    g = lower_bound * torch.sigmoid(zz)
    s = state.double() * g.exp()[..., None]
    b = torch.sigmoid(beta)
    s = s + b[:, None, None] * kc[..., None] * (vc - torch.einsum("hkv,hk->hv", s, kc))[:, None, :]
    o = torch.einsum("hkv,hk->hv", s, qc) / math.sqrt(D)
    y = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-6) * norm_w * torch.sigmoid(gate)
    return y, s


def test_reference_step_matches_float64_math():
    gen = torch.Generator().manual_seed(1)
    params = CASE.params(gen)
    state_pool, conv_pool = CASE.pools(gen)
    x = [t[:, 0] for t in CASE.tokens(gen, 2, 1)]
    slots = torch.tensor([5, 1])
    expected = [_float64_step([t[b] for t in x], conv_pool[s], state_pool[s], params, -5.0)
                for b, s in enumerate(slots.tolist())]
    y = naive.kda_decode_step(*x, *params, state_pool, conv_pool, slots)
    for b, s in enumerate(slots.tolist()):
        torch.testing.assert_close(y[b].double(), expected[b][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state_pool[s].double(), expected[b][1], rtol=1e-5, atol=1e-6)


def test_reference_prefill_block_equals_token_by_token_decode():
    """The chunked prefill reference (k3core's kda_chunk) continues a pooled state exactly as decode steps do."""
    gen = torch.Generator().manual_seed(7)
    params = CASE.params(gen)
    state_pool, conv_pool = CASE.pools(gen)
    x = CASE.tokens(gen, 2, 5)
    slots = torch.tensor([3, 0])
    y, state, conv = naive.kda_prefill_block(*x, *params, initial_state=state_pool[slots].clone(),
                                             initial_conv=conv_pool[slots].clone())
    steps = torch.stack([naive.kda_decode_step(*(t[:, i] for t in x), *params, state_pool, conv_pool, slots)
                         for i in range(5)], dim=1)
    torch.testing.assert_close(y, steps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_pool[slots], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv, conv_pool[slots], rtol=0, atol=0)


@pytest.mark.parametrize(("lower_bound", "block_v"), [(-5.0, None), (None, None), (-5.0, 4)])
def test_triton_decode_step_matches_reference(interpreted, lower_bound, block_v):
    gen = torch.Generator().manual_seed(2)
    params = CASE.params(gen)
    state_pool, conv_pool = CASE.pools(gen)
    x = [t[:, 0] for t in CASE.tokens(gen, 3, 1)]
    slots = torch.tensor([4, 0, 6])
    ref_pools = (state_pool.clone(), conv_pool.clone())
    y = decode_step_triton.kda_decode_step(*x, *params, state_pool, conv_pool, slots, lower_bound=lower_bound,
                                           block_v=block_v)
    y_ref = naive.kda_decode_step(*x, *params, *ref_pools, slots, lower_bound=lower_bound)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_pool, ref_pools[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv_pool, ref_pools[1], rtol=0, atol=0)


def test_split_decode_steps_in_a_row_match_reference(interpreted):
    """Value columns split over programs (block_v=4 of 16): the last program to arrive normalises and resets
    its (sequence, head) counter, so a second launch on the same counters is right again."""
    gen = torch.Generator().manual_seed(8)
    params = CASE.params(gen)
    pools = CASE.pools(gen)
    ref_pools = tuple(p.clone() for p in pools)
    slots = torch.tensor([1, 5, 3])
    for _ in range(2):
        x = [t[:, 0] for t in CASE.tokens(gen, 3, 1)]
        y = decode_step_triton.kda_decode_step(*x, *params, *pools, slots, block_v=4)
        y_ref = naive.kda_decode_step(*x, *params, *ref_pools, slots)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pools[0], ref_pools[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pools[1], ref_pools[1], rtol=0, atol=0)


@pytest.mark.parametrize(("heads_first", "state_after_inputs"), [(False, False), (True, False), (True, True)])
def test_decode_kernel_grid_orders_and_cache_hints_match_reference(interpreted, heads_first, state_after_inputs):
    """The launch's tuning switches (grid order, no cache hints, the state's loads after the inputs') change
    nothing in the results."""
    gen = torch.Generator().manual_seed(9)
    params = CASE.params(gen)
    pools = CASE.pools(gen)
    ref_pools = tuple(p.clone() for p in pools)
    slots = torch.tensor([6, 2])
    x = [t[:, 0] for t in CASE.tokens(gen, 2, 1)]
    y = decode_step_triton.kda_decode_split(*x, *params, *pools, slots, -5.0, None, 1e-6, 1e-6, CASE.dim, 4,
                                            evict_first=False, stream_store=False, heads_first=heads_first,
                                            state_after_inputs=state_after_inputs)
    y_ref = naive.kda_decode_step(*x, *params, *ref_pools, slots)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[0], ref_pools[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools[1], ref_pools[1], rtol=0, atol=0)


def test_triton_decode_leaves_other_slots_alone(interpreted):
    gen = torch.Generator().manual_seed(3)
    params = CASE.params(gen)
    state_pool, conv_pool = CASE.pools(gen)
    before = (state_pool.clone(), conv_pool.clone())
    x = [t[:, 0] for t in CASE.tokens(gen, 2, 1)]
    decode_step_triton.kda_decode_step(*x, *params, state_pool, conv_pool, torch.tensor([2, 5]))
    untouched = [0, 1, 3, 4, 6]
    assert torch.equal(state_pool[untouched], before[0][untouched])
    assert torch.equal(conv_pool[untouched], before[1][untouched])
    assert not torch.equal(state_pool[2], before[0][2])


def _decode_sequentially(tokens, params, pools, slots, n):
    """y of the first n tokens, one kda_decode_step each."""
    return torch.stack([decode_step_triton.kda_decode_step(*(t[:, i] for t in tokens), *params, *pools, slots)
                        for i in range(n)], dim=1)


def test_replay_verify_equals_sequential_decode(interpreted):
    """Two verify steps with a draft accepted in between give exactly the sequential-decode results.

    (Acceptance counts that differ per sequence are covered against the reference below.)"""
    gen = torch.Generator().manual_seed(4)
    params = CASE.params(gen)
    pools = CASE.pools(gen)
    seq_pools = tuple(p.clone() for p in pools)
    slots = torch.tensor([3, 6])
    n, a = 2, 1
    first = CASE.tokens(gen, 2, n + 1)
    second = CASE.tokens(gen, 2, n + 1)
    y1, drafts = kda_verify_replay(*first, *params, *pools, slots)
    y2, _ = kda_verify_replay(*second, *params, *pools, slots, previous_drafts=drafts,
                              n_accepted=torch.tensor([a, a]))
    # Sequential decode of the verified history: t0 and the accepted draft, then the second window.
    assert torch.equal(y1[:, : a + 1], _decode_sequentially(first, params, seq_pools, slots, a + 1))
    window = _decode_sequentially(second, params, tuple(p.clone() for p in seq_pools), slots, n + 1)
    assert torch.equal(y2, window)  # the new window's drafts too, not only t0
    _decode_sequentially(second, params, seq_pools, slots, 1)  # commit t0 of the second window
    assert torch.equal(pools[0], seq_pools[0])
    assert torch.equal(pools[1], seq_pools[1])


def test_triton_verify_matches_reference_and_snapshots(interpreted):
    """Value-split programs (block_v=8 of 16) with replay and snapshots; the unsplit replay path is covered
    by the sequential-decode equality test."""
    block_v = 8
    gen = torch.Generator().manual_seed(5)
    params = CASE.params(gen)
    pools = CASE.pools(gen)
    ref_pools = tuple(p.clone() for p in pools)
    slots = torch.tensor([2, 0])
    replay = (*CASE.tokens(gen, 2, 2)[:5], torch.tensor([2, 1]))
    x = CASE.tokens(gen, 2, 2)
    snaps = torch.empty(2, 2, CASE.heads, CASE.dim, CASE.dim)
    ref_snaps = torch.empty_like(snaps)
    y = decode_triton.fused_kda_recurrent(*x, *params, *pools, slots, replay=replay, n_commit=1, snapshots=snaps,
                                          block_v=block_v)
    y_ref = naive.fused_kda_recurrent(*x, *params, *ref_pools, slots, replay=replay, n_commit=1,
                                      snapshots=ref_snaps)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snaps, ref_snaps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools[0], ref_pools[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools[1], ref_pools[1], rtol=0, atol=0)


# Positions in (q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool, slots).
@pytest.mark.parametrize(
    ("index", "spoil", "field"),
    [(1, lambda t: t[..., :8], "k"), (12, lambda t: t.float(), "slots"),
     (10, lambda t: t.double(), "state_pool"), (7, lambda t: t[:1], "A_log")],
)
def test_bad_input_names_the_field(interpreted, index, spoil, field):
    gen = torch.Generator().manual_seed(6)
    args = [*CASE.tokens(gen, 2, 1), *CASE.params(gen), *CASE.pools(gen), torch.tensor([0, 1])]
    args[index] = spoil(args[index])
    with pytest.raises(ValueError, match=field):
        decode_triton.fused_kda_recurrent(*args)
