"""The AttnRes phase-1 bench (`bench.kernels --only attnres_phase1`, kernels/perf/attnres_cases.py): the
phase 1s it times as served and the bytes its bandwidth figures divide by, held to hand-derived values.
The kernels themselves are tested in test_attnres_block_logits.py and test_attnres_inter.py (on the GPU
too).
"""

from __future__ import annotations


def test_bench_counts_the_served_phases_and_their_bytes():
    """kernels/perf/attnres_cases: the phase 1s of a decode forward, hand-derived from the presets (K3: 93
    layers in blocks of 12, two sites a layer and the final one; mini: 17 layers in blocks of 8), and the
    least bytes of K3's fixed bench shape at decode, by hand."""
    from kernels.perf.attnres_cases import forward_phases, phase1_bytes

    k3 = [(n, 24, 187 - 24 * (n - 1)) for n in range(1, 8)] + [(8, 18, 19), (9, 1, 1)]
    assert forward_phases("k3") == k3
    assert forward_phases("mini") == [(1, 16, 35), (2, 16, 19), (3, 2, 3), (4, 1, 1)]
    blocks, accumulators, stats = 8 * 64 * 7168 * 2, 24 * 64 * 7168 * 4, 24 * 64 * 2 * 4
    cached, new, parts = 24 * 7 * 64 * 4, 25 * 64 * 4, 2 * 25 * 7168 * 2
    assert phase1_bytes(64, 7168, 8, 24, 25) == blocks + accumulators + stats + cached + new + parts
    assert phase1_bytes(64, 7168, 8, 24, 25, copy=True) - phase1_bytes(64, 7168, 8, 24, 25) == 64 * 7168 * 2


def test_decode_bench_counts_a_forwards_merges():
    """kernels/perf/attnres_decode_cases: a merge's least bytes (float32 accumulator, max and denominator and
    the partial sum read, RMSNorm(h) written, h not), and mini's decode forward (17 layers in blocks of 8: 35
    sites, of which 3 start a block and 1 is final) = its phase 1s as served + 31 merges with a partial sum
    + 4 without, by hand."""
    from kernels.perf.attnres_cases import forward_phases, phase1_bytes
    from kernels.perf.attnres_decode_cases import forward_bytes, merge_bytes

    assert merge_bytes(64, 7168, True) == 64 * 7168 * (4 + 2 + 2) + 64 * 2 * 4
    assert merge_bytes(64, 7168, False) == 64 * 7168 * (4 + 2) + 64 * 2 * 4
    phases = sum(phase1_bytes(8, 2048, N, Q, S, copy=True) for N, Q, S in forward_phases("mini"))
    assert forward_bytes("mini", 8) == phases + 31 * merge_bytes(8, 2048, True) + 4 * merge_bytes(8, 2048, False)


def test_decode_bench_forms_compute_the_same_forward(interpreted):
    """Every form of the decode bench's served forward (the block copy fused into its logits kernel, merges
    without h) gives the baseline's final normed output bit for bit, on nano's layout; the branched forms (the
    newest block folded in by the merges: other float32 sums) to within bf16 rounding."""
    import torch

    from kernels.perf.attnres_decode_cases import BASELINE, FORMS, ServedForward

    served = ServedForward("nano", 3, "cpu")
    want = served.run(BASELINE)
    assert want.isfinite().all() and want.abs().sum() > 0
    for form in FORMS[1:]:
        served.stacked.fill_(float("nan"))  # the fused copy must refill every completed block's slot
        if form.branched:
            torch.testing.assert_close(served.run(form), want, rtol=2e-2, atol=2e-2, msg=form.name)
        else:
            assert torch.equal(served.run(form), want), form.name
    assert any(form.branched for form in FORMS)
