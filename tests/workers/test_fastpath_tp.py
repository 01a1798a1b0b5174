"""The decode fast path at tensor-parallel degree > 1 (services/engine/fast_tensor_parallel.py), on the CPU
with gloo, every rank its own OS process.

Oracles: (1) one decode step from the same pool bytes on every rank of a TP group: the fast step writes the
bytes the reference TP step writes (and no others) and gives its logits; the rank's KDA heads equal the
matching heads of the TP 1 model's step on its own pool, its MLA latents the TP 1 latents, its logits the
TP 1 logits; one speculative verify through the fast path (`fast_verify`) equals the reference verify.
(2) Real decode worker processes at TP 2 (with the target as its own draft: speculative verify
windows through `fast_verify` too) and TP 4 with K3_DECODE_FASTPATH=1 stream k3core's offline greedy
tokens through the whole engine.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from kernels import dispatch
from services.engine.config import WorkerConfig
from services.engine.fast_tensor_parallel import ShardedMoe, graph_capturable
from services.engine.model_runner import ModelRunner, build_model
from services.engine.params import GenerationOptions
from services.engine.plan import ForwardItem
from services.engine.verify_replay import Verifier, replay_accepted
from services.runtime.ports import free_port
from tests.support.metrics import scrape
from tests.workers.client import generate
from tests.workers.cluster import HASH_BLOCK, OVERRIDES, make, running, worker_args
from tests.workers.oracle import build_reference, offline_generate

# Prompt lengths around the 16-token hash block: the step's token lands first, mid and last in a block.
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 15, 16, 31, 1))]
STEP_TOKENS = [11 * i + 4 for i in range(len(PROMPTS))]


class RankPool:
    """One rank's model (sharded when tp > 1), pool and reference runner, with PROMPTS prefilled by the
    reference layers and one more token reserved for each."""

    def __init__(self, tp: int, rank: int, model: str = "nano"):
        flags = ["--model", model, "--model-overrides", json.dumps(OVERRIDES), "--tp-size", str(tp),
                 "--hash-block-tokens", str(HASH_BLOCK), "--num-pages", "64"]
        config = WorkerConfig.load("decode", flags, env={})
        self.model = build_model(config, rank)
        self.manager = PrefixCacheManager(config.pool_layout(), config.num_pages, device="cpu")
        self.runner = ModelRunner(self.model, "cpu", max_model_len=256)
        self.fastpath = self.runner.decode_fastpath(self.manager, tp)  # K3_DECODE_FASTPATH=1 in the test env
        self.rids = [f"r{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(self.rids, PROMPTS, strict=True):
            self.manager.add_request(rid, prompt + [0])
            self.manager.reserve(rid, len(prompt))
            self.manager.pre_forward()
            self.runner.forward([prompt], self.manager.batch_view([rid]))
            self.manager.forward_done(rid)
            self.manager.commit_step()
            self.manager.reserve(rid, 1)

    @property
    def data(self) -> torch.Tensor:
        return self.manager.store.data

    def reference_step(self) -> torch.Tensor:
        return self.runner.forward([[t] for t in STEP_TOKENS], self.manager.batch_view(self.rids))

    def fast_step(self) -> torch.Tensor:
        return self.fastpath.forward([self.manager.requests[r] for r in self.rids], STEP_TOKENS)

    def pages(self) -> list[int]:
        reqs = [self.manager.requests[r] for r in self.rids]
        return sorted({p for r in reqs for p in r.state_pages}
                      | {p for r in reqs for b in r.blocks for p in b.pages})


# nano: latent MoE with its norm, Block AttnRes, full-rank KDA gate, gated MLA with q LoRA; nano-kl (the Kimi
# Linear form): plain MoE (one all-reduce after routed + shared), plain residual, low-rank gate, no LoRA.
MODELS = ("nano", "nano-kl")


def _check_one_step(rank: int, tp: int, port: int, triton: bool = False) -> None:
    """Runs in each rank's process (raises on a mismatch; the parent re-raises it). triton: the fast forms
    through the Triton launchers (under TRITON_INTERPRET=1), for nano only."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        for model in MODELS[:1] if triton else MODELS:
            _check_model(model, rank, tp, triton)
        check_one_verify(rank, tp, triton)  # the same ranks, while they are up (process start costs more than it)
    finally:
        dist.destroy_process_group()


def _check_model(model: str, rank: int, tp: int, triton: bool = False) -> None:
    ours = RankPool(tp, rank, model)
    moe_forms = [f for f in ours.fastpath.decoder.ffn if isinstance(f, ShardedMoe)]
    assert len(moe_forms) == sum(layer.is_moe for layer in ours.model.model.layers) > 0
    assert not graph_capturable(ours.model)  # gloo collectives: never inside a CUDA graph
    # A rank keeps the dense experts where an unsharded layer runs the routed form (the default; its sentinel
    # expert takes the other ranks' pairs) and draws after its forward (no look-ahead, no argmax in the graph).
    assert any(f.inner.dense(t) for f in moe_forms for t in range(1, 129))
    assert not any(f.inner.routed(t) for f in moe_forms for t in range(1, 129))
    assert not ours.fastpath.draw_in_graph and not ours.fastpath.lookahead
    before = ours.data.clone()
    with pytest.MonkeyPatch.context() as patch:
        if triton:
            patch.setattr(dispatch, "use_triton", lambda *tensors: True)
        fast_logits = ours.fast_step()
    fast_bytes = ours.data.clone()
    ours.data.copy_(before)
    ref_logits = ours.reference_step()
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-4, atol=1e-4)
    touched = ours.pages()
    torch.testing.assert_close(fast_bytes[touched].view(torch.float32),
                               ours.data[touched].view(torch.float32), rtol=1e-4, atol=1e-4)
    scratch = {ours.fastpath.builder.scratch_kda, ours.fastpath.builder.scratch_mla}
    rest = [p for p in range(ours.manager.pool.num_pages) if p not in touched and p not in scratch]
    assert torch.equal(fast_bytes[rest], before[rest])  # no other page (another rank's heads: none here)
    ours.data.copy_(fast_bytes)
    _check_against_tp1(ours, fast_logits, rank, tp, model)


def _check_against_tp1(ours: RankPool, fast_logits: torch.Tensor, rank: int, tp: int, model: str) -> None:
    """The rank's shard of the fast step equals the unsharded model's reference step (its own TP 1 pool), up
    to the rounding of differently split GEMMs and sums (the residual stream differs in the last bits)."""
    full = RankPool(1, 0, model)
    torch.testing.assert_close(fast_logits, full.reference_step(), rtol=1e-4, atol=1e-4)
    view, full_view = ours.manager.batch_view(ours.rids), full.manager.batch_view(full.rids)
    config = ours.model.config
    heads = config.kda_num_heads // tp
    mine = slice(rank * heads, (rank + 1) * heads)
    for layer in range(len(config.kda_layers)):
        (conv, state), (full_conv, full_state) = view.kda_read(layer), full_view.kda_read(layer)
        assert state.shape[1] == heads
        torch.testing.assert_close(state, full_state[:, mine], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(conv, full_conv[:, :, mine], rtol=1e-3, atol=1e-4)
    for layer in range(len(config.mla_layers)):
        for seq in range(len(ours.rids)):
            torch.testing.assert_close(view.mla_read(layer, seq), full_view.mla_read(layer, seq),
                                       rtol=1e-3, atol=1e-4)


WINDOWS = [4, 1, 5, 1, 3]  # within each request's hash block (prompt lengths 5, 15, 16, 31, 1)
COUNTS = [2, 1, 5, 1, 1]  # tokens each window keeps: partial, whole and none of the drafts


def check_one_verify(rank: int, tp: int, triton: bool = False) -> None:
    """One verify of speculative windows through the fast path (`fast_verify`) against the reference verify
    from the same pool bytes: logits, captured KDA inputs, bytes after the forward and after a partial
    replay. triton: through the Triton launchers (CPU tensors: under TRITON_INTERPRET=1)."""
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


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: ~35 s on the shared 2 cores
def test_one_fast_step_and_verify_write_the_reference_tp_bytes(tp, monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    mp.spawn(_check_one_step, args=(tp, free_port()), nprocs=tp)


@pytest.mark.slow  # ~80 s: every Triton program of a step and a verify interpreted, on 4 ranks
def test_tp4_ranks_through_the_triton_launchers_under_the_interpreter(monkeypatch):
    """The GPU forms at one KDA head and one MLA head per rank, against the same oracles."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    mp.spawn(_check_one_step, args=(4, free_port(), True), nprocs=4)


GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SELF_DRAFT = ("--draft-model", "nano", "--draft-model-overrides", json.dumps(OVERRIDES),
              "--num-speculative-tokens", "3")


@pytest.fixture(scope="module")
def fast_workers(tmp_path_factory, transfer):
    root = tmp_path_factory.mktemp("fast_tp")
    env = {"K3_DECODE_FASTPATH": "1"}
    procs = {tp: make(root, f"decode{tp}", worker_args("decode", tp, transfer.address, *extra))
             for tp, extra in ((2, SELF_DRAFT), (4, ()))}
    for proc in procs.values():
        proc.env.update(env)
    yield from running(procs)


@pytest.mark.parametrize("tp", [2, 4])
async def test_fast_path_worker_streams_the_offline_greedy_tokens(fast_workers, tp):
    reference = build_reference("nano", OVERRIDES)
    options = GenerationOptions.from_proto(GREEDY, vocab_size=reference.config.vocab_size,
                                           max_tokens_limit=999)
    prompt = [(5 * j + tp) % 250 + 1 for j in range(21)]
    chunks = await generate(fast_workers[tp].address, f"fast{tp}", prompt, GREEDY)
    assert [t for c in chunks for t in c.token_ids] == offline_generate(reference, prompt, options)
    if tp == 2:  # with a draft: verify windows (fast_verify) between the plain decode steps
        metrics = scrape(fast_workers[tp].info["metrics_address"])
        assert metrics.value("k3_decode_spec_acceptance_rate") == 1.0  # the target is its own draft
        assert any(len(c.token_ids) > 1 for c in chunks)
