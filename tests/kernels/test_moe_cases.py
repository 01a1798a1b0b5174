"""The latent-MoE benchmark's own logic (kernels/perf/moe_cases.py, no GPU): its L2-fair routings, its
command-line tile variants and their labels and launcher arguments."""

from __future__ import annotations

import inspect

import pytest
import torch

from k3core.quant.mxfp4 import quantize
from kernels.moe import latent_moe_decode_triton
from kernels.moe.tiles import Tile
from kernels.perf import moe_cases
from kernels.perf.moe_cases import Variant, parse_tiles


@pytest.mark.parametrize("T", [1, 2, 4, 8, 16])
def test_l2_fair_routings_share_no_expert_with_the_call_before(T):
    """Consecutive sets (cyclically: the last before the first) name disjoint experts, so a timed call never
    finds the previous call's experts in the L2: 16 sets at T=1 (all 256 experts once), one at T=16; every
    token names k distinct experts; T > 1: tokens 0 and 1 share one."""
    sets = moe_cases.routings(T, torch.Generator().manual_seed(T))
    assert len(sets) == max(1, min(16, moe_cases.E // (T * moe_cases.TOP_K)))
    for s, ids in enumerate(sets):
        assert ids.shape == (T, moe_cases.TOP_K) and ids.dtype == torch.int32 and int(ids.max()) < moe_cases.E
        assert all(row.unique().numel() == moe_cases.TOP_K for row in ids)
        if T > 1:
            assert (ids[1] == ids[0, 0]).any()
        if len(sets) > 1:
            before = sets[s - 1]
            assert not torch.isin(ids, before).any()
    if T == 1:
        assert torch.cat(sets).unique().numel() == moe_cases.E


def test_tile_pairs_parse_from_the_command_line():
    assert parse_tiles("128,64,4,4,168/64,128,4,3;32,32,2,1/16,32,1,2,0,2;16,128,2,2/32,128,2,2/T1,2") == (
        Variant(Tile(128, 64, 4, 4, 168), Tile(64, 128, 4, 3)),
        Variant(Tile(32, 32, 2, 1), Tile(16, 32, 1, 2, 0, 2)),
        Variant(Tile(16, 128, 2, 2), Tile(32, 128, 2, 2), batches=(1, 2)))
    assert parse_tiles("64,128,2,2/128,128,2,2/G0;64,128,2,2/128,128,2,2/T4/G2/D0") == (
        Variant(Tile(64, 128, 2, 2), Tile(128, 128, 2, 2), gluon_stages=0),
        Variant(Tile(64, 128, 2, 2), Tile(128, 128, 2, 2), batches=(4,), gluon_stages=2, gluon_down_stages=0))
    assert Variant(None, None, batches=(1,)).runs_at(1) and not Variant(None, None, batches=(1,)).runs_at(4)
    assert Variant(None, None).runs_at(4)


def test_variant_labels_and_launcher_arguments():
    """The labels docs/kernels.md and the results JSON cite for the Gluon forms, and `tuning()` naming only the
    launcher's own keyword arguments (a renamed launcher knob fails here, not in a device run)."""
    assert Variant(None, None).label() == "ours(gu=default,down=default)"
    assert Variant(None, None, gluon_stages=0, gluon_down_stages=0).label() == (
        "ours(gu=default,triton,down=default,triton)")
    assert Variant(None, None, gluon_stages=2, gluon_wgmma=True).label() == "ours(gu=default,gluon s2,wgmma,down=default)"
    assert Variant(Tile(64, 128, 2, 2), None, gluon_wgmma=False, gluon_down_stages=4,
                   gluon_down_wgmma=True).label() == "ours(gu=64x128,w2,s2,mma,down=default,gluon s4,wgmma)"
    assert Variant(None, None, gluon_fp8=True, down_fp8=True, gluon_fused=True).label() == (
        "ours(gu=default,fp8,down=default,fp8,one launch)")
    assert Variant(None, None, gluon_fp8=True, down_fp8=True, gluon_fused=False).tuning()["gluon_fused"] is False
    launcher = inspect.signature(latent_moe_decode_triton.latent_moe_decode_prepared).parameters
    tuning = Variant(Tile(64, 128, 2, 2), Tile(128, 128, 4, 3), gluon_stages=3, gluon_down_stages=0,
                     gluon_wgmma=True, gluon_down_wgmma=True).tuning()
    assert set(tuning) <= set(launcher) and tuning["gate_up_tile"] == Tile(64, 128, 2, 2)
    assert (tuning["gluon_stages"], tuning["gluon_down_stages"], tuning["gluon_wgmma"], tuning["gluon_down_wgmma"]) == (
        3, 0, True, True)


def _tiny_packs(gen: torch.Generator):
    """Tiny canonical MXFP4 experts (E = 2, l = 256, F = 128) for the layout preparation."""
    return (*quantize(torch.randn(2, 256, 256, generator=gen)), *quantize(torch.randn(2, 256, 128, generator=gen)))


def test_each_layout_is_prepared_once_and_each_variant_precompiles_on_its_own(monkeypatch):
    """`prepare_layouts` prepares one PreparedExperts per layout the variants read (recorded in its flags), and
    `precompile` records every variant's launches on the experts of its own layout, not on the bf16 ones. The
    launcher and the compile workers are stand-ins here (FP8 experts serve only CUDA calls): the test checks
    which experts each variant's call receives."""
    gen = torch.Generator().manual_seed(0)
    packs = _tiny_packs(gen)
    bf16, fp8, fp8_down = Variant(None, None), Variant(None, None, gluon_fp8=True), Variant(
        None, None, gluon_fp8=True, down_fp8=True, batches=(4,))
    prepared = moe_cases.prepare_layouts(packs, (bf16, fp8, fp8_down, Variant(Tile(64, 128, 2, 2), None)))
    assert set(prepared) == {(False, False), (True, False), (True, True)}
    assert all((e.gate_up_fp8, e.down_fp8) == layout for layout, e in prepared.items())
    calls, compiled = [], []
    monkeypatch.setattr(latent_moe_decode_triton, "latent_moe_decode_prepared",
                        lambda x, ids, w, experts, **tuning: calls.append((x.shape[0], experts, tuning)))
    monkeypatch.setattr("kernels.compile_check.compile_specs", lambda specs, workers: compiled.append(specs))
    moe_cases.precompile((1, 4), (bf16, fp8, fp8_down), prepared, device="cpu")
    assert [(T, experts) for T, experts, _ in calls] == [
        (1, prepared[(False, False)]), (1, prepared[(True, False)]),
        (4, prepared[(False, False)]), (4, prepared[(True, False)]), (4, prepared[(True, True)])]
    assert all(c[1] is prepared[v.layout()] for c, v in zip(calls, (bf16, fp8, bf16, fp8, fp8_down), strict=True))
    assert len(compiled) == 1
