"""The speculative verify forward through the decode fast path (services/engine/fast_verify.py) at TP 1, on
the CPU (TP 2: `test_fastpath_tp`, in its rank processes and its worker with a draft).

Oracles: (1) the reference verify forward from the same pool bytes: the same logits at every window token,
the same captured KDA inputs, the same pool bytes after the forward (no KDA state written) and after the
replay of partly accepted windows. (2) The whole engine with a draft (TP 1 in-process): greedy tokens and
prefix-cache contents equal offline k3core computation (`test_speculative.run_engine`), every draft accepted
when the target is its own draft, and the verify forwards did run on the fast path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine import fast_verify
from tests.workers.oracle import offline_generate
from tests.workers.test_fastpath_tp import check_one_verify
from tests.workers.test_speculative import PROMPTS, SELF_DRAFT, options, reference, run_engine

ROOT = Path(__file__).resolve().parents[2]


def test_one_fast_verify_equals_the_reference_verify(monkeypatch):
    """At TP 1 (TP 2: in `test_fastpath_tp`'s rank processes)."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    check_one_verify(0, 1)


@pytest.mark.slow  # ~30 s: the interpreter runs every Triton program of the forward
def test_one_fast_verify_through_the_triton_launchers_under_the_interpreter():
    """The GPU form (fused recurrence with n_commit=0, paged MLA per row, fused MoE and glue kernels)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "K3_DECODE_FASTPATH": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.workers.test_fastpath_tp import check_one_verify; check_one_verify(0, 1, True)"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_engine_with_a_draft_verifies_on_the_fast_path(monkeypatch):
    """In-process at TP 1 (`run_engine` checks the prefix cache against offline prefill of one whole model);
    TP 2 through a real worker: `test_fastpath_tp.test_fast_path_worker_streams_the_offline_greedy_tokens`."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    calls = []
    forward = fast_verify.FastVerify.forward
    monkeypatch.setattr(fast_verify.FastVerify, "forward",
                        lambda self, *args: calls.append(1) or forward(self, *args))
    run = run_engine(*SELF_DRAFT, "--num-speculative-tokens", "3")
    assert calls  # the verify forwards ran on the fast path
    assert run.accepted == run.proposed > 0  # the target is its own draft: the fast verify agrees with it
    assert run.tokens == [offline_generate(reference(), p, options(i)) for i, p in enumerate(PROMPTS)]
