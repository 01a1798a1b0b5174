"""The MLA decode layer's switches (services/engine): K3_MLA_ROPE_BRANCH (the absorbed query's rope copy
beside the W_uk product, or after it on the main chain) and K3_MLA_INT32 (the kernel's page table and lengths
as int32 copies, or the step image's int64 parts), each way: the fast path's decode step on nano in float32
against the reference layers' (CPU: the kernels' references through dispatch; the branch is a no-op off CUDA,
so the two rope orders run one after the other and each must fill the absorbed query's rope columns)."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels import dispatch
from services.engine.fast_attention import MLA_ROPE_BRANCH_ENV
from services.engine.fast_decoder import MLA_INT32_ENV
from tests.workers.oracle import build_reference
from tests.workers.test_fastpath import _one_step


@pytest.fixture(scope="module")
def nano():
    return build_reference("nano", seed=11)


@pytest.mark.parametrize(("rope_branch", "int32"), [("1", "1"), ("0", "1"), ("1", "0")])
def test_each_setting_gives_the_reference_step(nano, monkeypatch, rope_branch, int32):
    monkeypatch.setenv(MLA_ROPE_BRANCH_ENV, rope_branch)
    monkeypatch.setenv(MLA_INT32_ENV, int32)
    reference = _one_step(copy.deepcopy(nano), False, torch.float32)
    index_dtypes = []
    paged = dispatch.mla_decode_paged

    def recording(q, cache, page_table, lengths, *args, **kwargs):
        index_dtypes.append((page_table.dtype, lengths.dtype))
        return paged(q, cache, page_table, lengths, *args, **kwargs)

    monkeypatch.setattr(dispatch, "mla_decode_paged", recording)
    logits = _one_step(copy.deepcopy(nano), True, torch.float32)
    want = torch.int32 if int32 == "1" else torch.int64
    assert index_dtypes and set(index_dtypes) == {(want, want)}  # the fast path's MLA layers read that type
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
