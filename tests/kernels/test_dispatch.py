"""The dispatch layer: CPU tensors take the reference, the env switch forces it, and results agree."""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.kda import naive as kda_naive
from kernels.kda.verify_triton import kda_verify_replay
from kernels.mla import naive as mla_naive
from kernels.moe import naive as moe_naive
from tests.kernels.kda_inputs import KdaCase


class FakeCudaTensor:
    """FAKE: no GPU here. use_triton reads only `is_cuda`, so this stands in for a CUDA tensor."""

    is_cuda = True


def test_cpu_tensors_take_the_reference():
    assert not dispatch.use_triton(torch.zeros(1))
    assert not dispatch.use_triton(FakeCudaTensor(), torch.zeros(1))  # any CPU input keeps the reference


def test_cuda_tensors_take_triton_unless_the_env_forces_the_reference(monkeypatch):
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    assert dispatch.use_triton(FakeCudaTensor())  # tests/kernels runs only where triton is installed
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.use_triton(FakeCudaTensor())


def test_dispatched_call_equals_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 48, generator=gen)
    cache = torch.randn(4, 8, 48, generator=gen)
    table = torch.tensor([[0, 1], [3, 2]]).int()
    lengths = torch.tensor([9, 16]).int()
    got = dispatch.mla_decode_paged(q, cache, table, lengths, 0.5, latent_dim=32)
    assert torch.equal(got, mla_naive.mla_decode_paged(q, cache, table, lengths, 0.5, latent_dim=32))


def test_tuning_arguments_are_accepted_on_the_reference_path():
    """A caller tuned for the GPU (block, num_warps) must still run where dispatch picks the reference."""
    gate_up = torch.randn(3, 2 * 8, generator=torch.Generator().manual_seed(1))
    got = dispatch.situ_glu_fused(gate_up, block=16, num_warps=2)
    assert torch.equal(got, moe_naive.situ_glu_fused(gate_up))


def test_dispatched_verify_replays_on_the_reference_recurrence():
    case = KdaCase()
    gen = torch.Generator().manual_seed(2)
    params, pools, x = case.params(gen), case.pools(gen), case.tokens(gen, 2, 3)
    ref_pools = tuple(p.clone() for p in pools)
    slots = torch.tensor([1, 4])
    y, drafts = dispatch.kda_verify_replay(*x, *params, *pools, slots)
    y_ref, _ = kda_verify_replay(*x, *params, *ref_pools, slots, recurrent=kda_naive.fused_kda_recurrent)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(pools, ref_pools, strict=True))
    assert all(torch.equal(d, t[:, 1:]) for d, t in zip(drafts, x[:5], strict=True))
