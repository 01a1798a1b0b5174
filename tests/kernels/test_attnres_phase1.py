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
