"""The dispatch layer: CPU tensors take the reference, the env switch forces it, and results agree."""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.mla import naive as mla_naive


def test_cpu_tensors_take_the_reference():
    assert not dispatch.use_triton(torch.zeros(1))


def test_force_reference_env(monkeypatch):
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.use_triton(torch.zeros(1))


def test_dispatched_call_equals_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 48, generator=gen)
    cache = torch.randn(4, 8, 48, generator=gen)
    table = torch.tensor([[0, 1], [3, 2]]).int()
    lengths = torch.tensor([9, 16]).int()
    got = dispatch.mla_decode_paged(q, cache, table, lengths, 0.5, latent_dim=32)
    assert torch.equal(got, mla_naive.mla_decode_paged(q, cache, table, lengths, 0.5, latent_dim=32))
