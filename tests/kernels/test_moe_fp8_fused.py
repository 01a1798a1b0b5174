"""The FP8 gate/up and FP8 down of the latent-MoE decode in one launch (kernels/moe/decode_fp8_fused_gluon.py): on
the CPU which calls it serves and which the launcher gives it (the kernels replaced by named recording stand-ins,
since Gluon has no interpreter); on the GPU bit-equal to the FP8 two launches at the same stages, within the
float32 oracle's bar, repeatable, replayed from a CUDA graph, its counters zero after every call."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import (
    decode_fp8_down_gluon,
    decode_fp8_fused_gluon,
    decode_fp8_gluon,
    decode_fused_gluon,
    latent_moe_decode_triton,
    naive,
    prepared_experts,
)
from kernels.moe.tiles import GLUON_STAGES, Tile
from kernels.perf.moe_cases import MAX_REL_ERR
from tests.kernels.moe_problems import moe_problem

E, K, L, F = 12, 4, 256, 512  # 2 gate/up steps and 4 down steps of 128 columns a program


def _problem(tokens: int, device: str, seed: int):
    """bf16 x [T, l], ids [T, k] (token 1 shares token 0's first expert), router weights, FP8-prepared experts
    and the canonical packs."""
    packs, x, ids, w = moe_problem(tokens, E, K, L, F, device, seed)
    experts = prepared_experts.prepare_experts(*packs, gate_up_fp8=True, down_fp8=True)
    return x, ids, w, experts, packs


def test_serves_only_cuda_calls_with_both_fp8_kernels_and_no_split():
    x = torch.zeros(4, L, dtype=torch.bfloat16)
    assert not decode_fp8_fused_gluon.serves(x, F, 1)  # CPU tensors
    if decode_fp8_fused_gluon.gluon is None or not torch.cuda.is_available():
        return
    cuda = x.cuda()
    assert decode_fp8_fused_gluon.serves(cuda, F, 1)
    assert not decode_fp8_fused_gluon.serves(cuda, F, 2)  # down's reduction split
    assert not decode_fp8_fused_gluon.serves(cuda, 128, 1)  # one down step a program
    assert not decode_fp8_fused_gluon.serves(torch.zeros(17, L, dtype=torch.bfloat16, device="cuda"), F, 1)


@pytest.mark.parametrize(("tokens", "tuning", "form"), [
    (4, {}, "two"),  # 16 pairs: below fused_by_default's 48, two launches
    (12, {}, "one"),  # 48 pairs: fused_by_default
    (12, {"gluon_fused": False}, "two"),
    (4, {"gluon_fused": True, "gluon_stages": 4, "gluon_down_stages": 2}, "one"),
    (12, {"down_tile": Tile(splits=2)}, "two"),  # a named down tile: not the default one launch
    (12, {"gluon_fused": True, "down_tile": Tile(splits=2)}, "two"),  # a split down cannot wait in one launch
])
def test_the_launcher_gives_fp8_experts_the_one_launch_where_gluon_fused_says(monkeypatch, tokens, tuning, form):
    """FP8-prepared experts (both layouts) take the one launch where `gluon_fused` (default fused_by_default)
    holds and the down is not split, at the FP8 kernels' stages (GLUON_STAGES unless given); else the two FP8
    launches. The FP8 kernels are replaced by named stand-ins that record their calls (no Gluon on CPU)."""
    calls = []
    monkeypatch.setattr(decode_fp8_gluon, "serves", lambda x, F: True)
    monkeypatch.setattr(decode_fp8_down_gluon, "serves", lambda x, F, splits: True)
    monkeypatch.setattr(decode_fp8_fused_gluon, "serves", lambda x, F, splits: splits == 1)
    # The stand-ins zero the partial sums they stand in for, so the real pair-sum launch after them reads
    # defined values (torch.empty's garbage overflowed in the interpreter).
    monkeypatch.setattr(decode_fp8_fused_gluon, "gate_up_down",
                        lambda *a: (a[5].zero_(), calls.append(("one", a[-3:]))))  # (s, gate/up, down stages)
    monkeypatch.setattr(decode_fp8_gluon, "gate_up", lambda *a: calls.append(("gate_up", a[-2])))
    monkeypatch.setattr(decode_fp8_down_gluon, "down", lambda *a: (a[5].zero_(), calls.append(("down", a[-1]))))
    x, ids, w, experts, _packs = _problem(tokens, "cpu", tokens)
    latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, **tuning)
    stages = (tuning.get("gluon_stages", GLUON_STAGES), tuning.get("gluon_down_stages", GLUON_STAGES))
    if form == "one":
        assert calls == [("one", (decode_fp8_down_gluon.h_scale(4.0, 25.0), *stages))]
    else:
        assert calls == [("gate_up", stages[0]), ("down", stages[1])]


def _gpu() -> None:
    if decode_fp8_fused_gluon.gluon is None or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device with Gluon")


def _counters_zero(device: torch.device) -> bool:
    return not decode_fused_gluon._COUNTERS[device].any()


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages"), [(3, (3, 3)), (4, (2, 2)), (4, (4, 3)), (8, (3, 4)), (16, (3, 3))])
def test_one_launch_matches_the_two_fp8_launches_and_the_oracle_on_gpu(monkeypatch, tokens, stages):
    """At the same stages the one launch equals the FP8 two launches bit for bit (the same programs' arithmetic),
    is within the bench's bar of the float32 oracle, repeats bit-equal, and leaves its counters zero (N = 8 up
    to 8 tokens, 16 at 16; tokens sharing an expert)."""
    _gpu()
    launched = []
    real = decode_fp8_fused_gluon.gate_up_down
    monkeypatch.setattr(decode_fp8_fused_gluon, "gate_up_down", lambda *a: (launched.append(1), real(*a)))
    x, ids, w, experts, packs = _problem(tokens, "cuda", 400 + tokens)
    tuning = {"gluon_stages": stages[0], "gluon_down_stages": stages[1]}
    call = latent_moe_decode_triton.latent_moe_decode_prepared
    one = call(x, ids, w, experts, gluon_fused=True, **tuning)
    assert launched == [1] and _counters_zero(x.device)
    two = call(x, ids, w, experts, gluon_fused=False, **tuning)
    assert torch.equal(one, two)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    assert ((one.float() - ref).norm() / ref.norm()).item() < MAX_REL_ERR
    for _ in range(3):
        assert torch.equal(call(x, ids, w, experts, gluon_fused=True, **tuning), one)
    assert _counters_zero(x.device)


@pytest.mark.gpu
def test_one_launch_replays_from_a_cuda_graph():
    """Captured once, replayed on three new inputs (each replay's last program resets the counters): every
    replay equals the eager two-launch call on those inputs."""
    _gpu()
    x, ids, w, experts, _packs = _problem(4, "cuda", 7)
    call = latent_moe_decode_triton.latent_moe_decode_prepared
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(x, ids, w, experts, gluon_fused=True)  # warm-up: builds, sizes the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(x, ids, w, experts, gluon_fused=True)
    for seed in range(3):
        nx, nids, nw, *_ = _problem(4, "cuda", 500 + seed)
        for dst, src in ((x, nx), (ids, nids), (w, nw)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call(x, ids, w, experts, gluon_fused=False))
        assert _counters_zero(x.device)
