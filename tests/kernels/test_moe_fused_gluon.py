"""The one-launch gate/up + down of the latent-MoE decode (kernels/moe/decode_fused_gluon.py, `gluon_fused`): on the
GPU bit-equal to the two Gluon launches at the same tiles and within the float32 oracle's bar, its counters zero
after every call, replayed from a CUDA graph; on the CPU, which calls it serves and that the switch keeps CPU calls
on the Triton kernels with their own tiles."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import decode_fused_gluon, latent_moe_decode_triton, naive, prepared_experts
from kernels.moe.tiles import FUSED_STAGES, FUSED_TILES, Tile, fused_by_default
from tests.kernels.moe_problems import moe_problem

FUSED = FUSED_TILES  # the tiles the launcher ships with


def _problem(tokens: int, experts: int, top_k: int, latent: int, width: int, device: str, seed: int = 0):
    """x bf16 [T, l], ids [T, k] (token 1 names token 0's first expert), router weights, the canonical packs."""
    packs, x, ids, w = moe_problem(tokens, experts, top_k, latent, width, device, seed)
    return x, ids, w, packs


def test_serves_only_cuda_calls_with_equal_warps_one_h_part_and_no_split():
    """The fused kernel takes a call both Gluon kernels fit, on CUDA only, with one warp count for both tiles,
    h in one bf16 part and down's reduction whole."""
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    assert not decode_fused_gluon.serves(x, 256, 1, *FUSED)  # CPU tensors
    if decode_fused_gluon.gluon is None or not torch.cuda.is_available():
        return
    cuda = x.cuda()
    assert decode_fused_gluon.serves(cuda, 256, 1, *FUSED)
    assert not decode_fused_gluon.serves(cuda, 256, 2, *FUSED)
    assert not decode_fused_gluon.serves(cuda, 256, 1, FUSED[0], Tile(128, 128, 4, 3))
    assert not decode_fused_gluon.serves(cuda, 256, 1, FUSED[0], Tile(128, 128, 2, 3, splits=2))


def test_the_switch_keeps_cpu_calls_on_the_triton_kernels():
    """gluon_fused on CPU tensors changes nothing: bit-equal to the call without it (same Triton kernels, same
    default tiles, not FUSED_TILES), and within the oracle's bar."""
    x, ids, w, packs = _problem(2, 4, 2, 128, 128, "cpu")
    experts = prepared_experts.prepare_experts(*packs)
    fused = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gluon_fused=True)
    plain = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts)
    assert torch.equal(fused, plain)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    assert ((fused.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_default_takes_the_fused_form_from_48_pairs_to_fewer_than_sms():
    """The launcher's default: two launches below 48 (token, expert) pairs (T = 1, 2 measured slower) and from
    as many pairs as SMs (the warpgroup gate/up's range), one launch between."""
    sms = 132
    assert [fused_by_default(p, sms) for p in (16, 32, 47, 48, 64, 131, 132, 256)] == [
        False, False, False, True, True, True, False, False]


def test_counters_grow_zeroed_and_keep_the_outgrown_buffer_alive():
    """More pairs than the counters hold: a larger zeroed buffer, the old one kept (a graph captured before may
    still write it); fewer pairs reuse the buffer."""
    device = torch.device("cpu")
    decode_fused_gluon._COUNTERS.pop(device, None)
    small = decode_fused_gluon._counters(4, device)
    assert small.numel() >= 6 and decode_fused_gluon._counters(4, device) is small
    large = decode_fused_gluon._counters(small.numel(), device)
    assert large.numel() >= small.numel() + 2 and not large.any()
    assert any(t is small for t in decode_fused_gluon._OUTGROWN)
    decode_fused_gluon._COUNTERS.pop(device)


E, K, L, F = 12, 4, 512, 512  # the GPU cases' experts: 4 steps of 128 columns a program


def _gpu_call(tokens: int, seed: int, tiles: tuple[Tile, Tile], stages: tuple[int, int]):
    x, ids, w, packs = _problem(tokens, E, K, L, F, "cuda", seed)
    experts = prepared_experts.prepare_experts(*packs)
    tuning = {"gate_up_tile": tiles[0], "down_tile": tiles[1], "gluon_stages": stages[0],
              "gluon_down_stages": stages[1]}
    return x, ids, w, packs, experts, tuning


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "tiles", "stages"), [
    (1, FUSED, (3, 3)), (3, FUSED, (3, 4)), (16, FUSED, (2, 3)),
    (4, (Tile(128, 128, 4, 3), Tile(128, 128, 4, 3)), (3, 3)), (5, (Tile(64, 128, 2, 3), Tile(64, 128, 2, 3)), (3, 2))])
def test_fused_matches_the_two_launches_and_the_oracle_on_gpu(tokens, tiles, stages):
    """The one-launch form at the given tiles and stages equals the two Gluon launches bit for bit (the same
    programs' arithmetic) and the float32 oracle within 1e-2, tokens sharing experts; its counters are zero
    afterwards (the last program reset them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, ids, w, packs, experts, tuning = _gpu_call(tokens, 200 + tokens, tiles, stages)
    assert decode_fused_gluon.serves(x, F, 1, *tiles)
    fused = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gluon_fused=True, **tuning)
    two = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, **tuning)
    assert torch.equal(fused, two)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    assert ((fused.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert not decode_fused_gluon._COUNTERS[x.device].any()


@pytest.mark.gpu
def test_fused_replays_from_a_cuda_graph():
    """Captured once, replayed on three different inputs (the counters reset by each replay's last program):
    every replay equals the eager two-launch call on those inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, ids, w, _packs, experts, tuning = _gpu_call(4, 7, FUSED, (3, 3))
    call = lambda: latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gluon_fused=True,  # noqa: E731
                                                                       **tuning)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up: builds, sizes the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in range(3):
        nx, nids, nw, *_ = _problem(4, E, K, L, F, "cuda", 300 + seed)
        for dst, src in ((x, nx), (ids, nids), (w, nw)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, **tuning))
        assert not decode_fused_gluon._COUNTERS[x.device].any()


@pytest.mark.gpu
def test_the_default_call_at_64_pairs_is_the_fused_form_on_gpu(monkeypatch):
    """16 tokens x 4 experts with no tiles named: the launcher calls the one-launch form, at FUSED_TILES and
    FUSED_STAGES (bit-equal to naming them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, ids, w, _packs, experts, tuning = _gpu_call(16, 11, FUSED_TILES, FUSED_STAGES)
    launches = []
    launch = decode_fused_gluon.gate_up_down
    monkeypatch.setattr(decode_fused_gluon, "gate_up_down", lambda *a: launches.append(a[-4:]) or launch(*a))
    default = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts)
    assert launches == [(*FUSED_TILES, *FUSED_STAGES)]
    fused = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gluon_fused=True, **tuning)
    assert torch.equal(default, fused)
