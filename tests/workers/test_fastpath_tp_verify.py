"""The speculative verify forward through the decode fast path (services/engine/fast_verify.py), at TP 1 and
TP 2 (gloo, one OS process per rank), on the CPU.

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
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import dispatch
from services.engine import fast_verify
from services.engine.plan import ForwardItem
from services.engine.verify_replay import Verifier, replay_accepted
from services.runtime.ports import free_port
from tests.workers.oracle import offline_generate
from tests.workers.test_fastpath_tp import RankPool
from tests.workers.test_speculative import PROMPTS, SELF_DRAFT, options, reference, run_engine

ROOT = Path(__file__).resolve().parents[2]
WINDOWS = [4, 1, 5, 1, 3]  # within each request's hash block (prompt lengths 5, 15, 16, 31, 1)
COUNTS = [2, 1, 5, 1, 1]  # tokens each window keeps: partial, whole and none of the drafts


def _check_one_verify(rank: int, tp: int, port: int, triton: bool = False) -> None:
    """triton: the fast verify through the Triton launchers (CPU tensors: under TRITON_INTERPRET=1)."""
    torch.set_num_threads(1)
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        pool = RankPool(tp, rank)
        manager, model = pool.manager, pool.model
        items = []
        for i, (rid, window) in enumerate(zip(pool.rids, WINDOWS, strict=True)):
            drafts = [(13 * i + 5 * j) % 250 + 1 for j in range(window - 1)]
            manager.append_tokens(rid, drafts)
            manager.reserve(rid, window)
            items.append(ForwardItem(rid, manager.requests[rid].tokens[-window:], True))
        fast, plain = Verifier(model, manager, "cpu", tp, pool.fastpath), Verifier(model, manager, "cpu", tp)
        before = pool.data.clone()
        with pytest.MonkeyPatch.context() as patch:
            if triton:
                patch.setattr(dispatch, "use_triton", lambda *tensors: True)
            fast_run = fast.verify(items)
        fast_bytes = pool.data.clone()
        pool.data.copy_(before)
        plain_run = plain.verify(items)
        for got, want in zip(fast_run.logits, plain_run.logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert sorted(fast_run.inputs) == sorted(plain_run.inputs)
        for layer, tensors in plain_run.inputs.items():
            for got, want in zip(fast_run.inputs[layer], tensors, strict=True):
                torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast_bytes.view(torch.float32), pool.data.view(torch.float32), rtol=1e-4,
                                   atol=1e-4)  # latent rows of every window token; no state written
        plain_bytes = pool.data.clone()
        for run, start in ((plain_run, plain_bytes), (fast_run, fast_bytes)):
            pool.data.copy_(start)
            replay_accepted(plain.capture.layers, run.inputs, run.view.inner, WINDOWS, COUNTS)
            start.copy_(pool.data)
        torch.testing.assert_close(fast_bytes.view(torch.float32), plain_bytes.view(torch.float32), rtol=1e-4,
                                   atol=1e-4)
        assert not torch.equal(plain_bytes, before)  # the replay did advance the states
    finally:
        if tp > 1:
            dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_fast_verify_equals_the_reference_verify(tp, monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    if tp == 1:
        _check_one_verify(0, 1, 0)
    else:
        mp.spawn(_check_one_verify, args=(tp, free_port()), nprocs=tp)


@pytest.mark.slow  # ~30 s: the interpreter runs every Triton program of the forward
def test_one_fast_verify_through_the_triton_launchers_under_the_interpreter():
    """The GPU form (fused recurrence with n_commit=0, paged MLA per row, fused MoE and glue kernels)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "K3_DECODE_FASTPATH": "1", "PYTHONPATH": str(ROOT)}
    code = ("from tests.workers.test_fastpath_tp_verify import _check_one_verify; "
            "_check_one_verify(0, 1, 0, True)")
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
