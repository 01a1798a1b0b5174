"""The decode fast path's two AttnRes forms (services/engine/fast_decoder.py): branched (each merge folds in
the newest completed block, phase 1 a block early on a side branch) and the main-chain form
(K3_ATTNRES_BRANCH=0, or the prefill fast path), each against the reference layers' decode
step on nano in float32 (CPU: the kernels' references through dispatch; the branch is a no-op off CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from services.engine.fast_decoder import ATTN_RES_BRANCH_ENV, FastDecoder
from tests.workers.oracle import build_reference
from tests.workers.test_fastpath import _one_step


@pytest.fixture(scope="module")
def nano():
    return build_reference("nano", seed=5)


def _step_taking(nano, monkeypatch) -> tuple[torch.Tensor, int]:
    """One fast-path decode step's logits, and how many forwards took the branched form."""
    taken = []
    branched = FastDecoder._attn_res_branched
    monkeypatch.setattr(FastDecoder, "_attn_res_branched", lambda self, *a: taken.append(1) or branched(self, *a))
    return _one_step(copy.deepcopy(nano), True, torch.float32), len(taken)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_both_forms_give_the_reference_step(nano, monkeypatch, setting):
    monkeypatch.setenv(ATTN_RES_BRANCH_ENV, setting)
    reference = _one_step(copy.deepcopy(nano), False, torch.float32)
    logits, taken = _step_taking(nano, monkeypatch)
    assert (taken > 0) == (setting == "1")
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
