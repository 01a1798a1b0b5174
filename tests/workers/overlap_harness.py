"""An in-process engine (real scheduler, executor, cache manager, decode fast path with the kernels'
references, output processing with the byte tokenizer) driven step by step from a script of arrivals and
cancellations, so that the same interleaving runs with and without the decode overlap."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from k3core.tokenizer import ByteTokenizer
from services.engine.config import WorkerConfig
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.engine import Engine
from services.engine.executor import Executor
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.output import OutputProcessor
from services.engine.params import GenerationOptions
from services.engine.plan import RecordingManager
from services.engine.request import EngineRequest, StepOutput
from services.engine.scheduler import Scheduler
from tests.workers.cluster import OVERRIDES
from tests.workers.oracle import build_reference

STOP = common_pb2.FINISH_REASON_STOP


def harness_model():
    """nano with the cluster's OVERRIDES: the model the scripted engines' WorkerConfig describes."""
    return build_reference("nano", OVERRIDES)


HASH_BLOCK = 16
MAX_LEN = 256


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reason: int = 0
    error: Exception | None = None
    outputs: list[StepOutput] = field(default_factory=list)

    def __call__(self, out: StepOutput) -> None:
        self.outputs.append(out)
        self.tokens += out.token_ids
        self.text += out.text
        self.reason = out.finish_reason or self.reason
        self.error = out.error or self.error


def options(vocab: int, **params) -> GenerationOptions:
    return GenerationOptions.from_proto(common_pb2.SamplingParams(**params), vocab_size=vocab, max_tokens_limit=999)


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 250 + 1 for j in range(n)]


def scripted_requests(max_stop_ids: int) -> st.SearchStrategy:
    """A request of `interleaving`: (prompt length, temperature, seed, max_tokens, stop ids, arrival step,
    cancelled so many steps after it or None). Prompts up to 90 tokens and 14 new ones: rows reach the end of
    an 80-token block."""
    return st.tuples(st.integers(1, 90), st.sampled_from([0.0, 0.9]), st.integers(0, 9), st.integers(1, 14),
                     st.lists(st.integers(1, 262), max_size=max_stop_ids), st.integers(0, 5),
                     st.one_of(st.none(), st.integers(1, 8)))


def interleaving(vocab: int, requests: list[tuple]) -> dict[int, list[tuple]]:
    """The script of `scripted_requests` draws: request i is h<i>, every other one ignores the EOS."""
    script: dict[int, list[tuple]] = {}
    for i, (n, temperature, seed, max_tokens, stop_ids, arrive, cancel) in enumerate(requests):
        o = options(vocab, temperature=temperature, seed=seed, max_tokens=max_tokens, stop_token_ids=stop_ids,
                    ignore_eos=bool(i % 2))
        script.setdefault(arrive, []).append(("add", f"h{i}", prompt(i, n), o))
        if cancel is not None:
            script.setdefault(arrive + cancel, []).append(("cancel", f"h{i}"))
    return script


class ScriptedEngine:
    """`Engine` without its thread: `run(script)` submits and cancels at the given step numbers."""

    def __init__(self, model, overlap: bool, *, num_pages: int = 160, max_running: int = 8, budget: int = 64,
                 lookahead: bool | None = False, device: str = "cpu"):
        model = copy.deepcopy(model).to(device)  # the fast path fuses weights in place: one model per engine
        config = WorkerConfig.load("decode", ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                              str(HASH_BLOCK), "--num-pages", str(num_pages)], env={})
        self.manager = PrefixCacheManager(config.pool_layout(), num_pages, device=device)
        executor = Executor(self.manager, ModelRunner(model, device, max_model_len=MAX_LEN), rank=0, tp_size=1,
                            total_heads=model.config.kda_num_heads, instance=common_pb2.InstanceId())
        executor.fastpath = DecodeFastPath(model, self.manager, max_model_len=MAX_LEN, max_batch=max_running,
                                           lookahead=lookahead)
        recording = RecordingManager(self.manager)
        scheduler = Scheduler(recording, hash_block_tokens=HASH_BLOCK, max_running=max_running,
                              step_token_budget=budget, model_name="nano")
        tokenizer = ByteTokenizer()
        self.engine = Engine(executor, scheduler, recording, OutputProcessor(tokenizer, model.config.eos_token_id),
                             EngineMetrics.for_role("overlap_test"))
        self.engine.overlap.enabled = overlap
        self.overlapped = 0  # steps launched by the overlap
        advance = self.engine.overlap.advance
        self.engine.overlap.advance = lambda: self._count(advance())
        self.ahead = 0  # of which launched before the previous step's tokens were in (the look-ahead)
        lookahead = self.engine.overlap.lookahead
        if lookahead is not None:
            ahead = lookahead.advance
            lookahead.advance = lambda *args: (setattr(self, "ahead", self.ahead + 1), ahead(*args))[1]
        self.streams: dict[str, Stream] = {}
        self.requests: dict[str, EngineRequest] = {}
        self.finished_state: dict[str, torch.Tensor] = {}  # rid -> its KDA state pages' bytes when it left
        self.computed: dict[str, int] = {}  # rid -> tokens its forwards computed when it left
        self.pages: dict[str, tuple] = {}  # rid -> its block table's and state's page ids when it left
        finish = self.manager.finish
        self.manager.finish = lambda rid, keep=True: (self._snapshot(rid), finish(rid, keep))[1]

    def _count(self, launched: bool) -> bool:
        self.overlapped += launched
        return launched

    def _snapshot(self, rid: str) -> None:
        pages = self.manager.requests[rid].state_pages
        self.computed[rid] = self.manager.requests[rid].num_computed
        self.pages[rid] = ([tuple(b.pages) for b in self.manager.requests[rid].blocks], tuple(pages))
        self.finished_state[rid] = self.manager.store.data[pages].clone()

    def run(self, script: dict[int, list[tuple]], max_steps: int = 400) -> dict[str, Stream]:
        """script: step -> [("add", rid, prompt, options) | ("cancel", rid) | ("call", fn(engine), settle)]."""
        engine, last = self.engine, max(script, default=0)
        for step in range(max_steps):
            for event in script.get(step, []):
                if event[0] == "add":
                    self.streams[event[1]] = Stream()
                    self.requests[event[1]] = EngineRequest(event[1], event[2], event[3], self.streams[event[1]])
                    engine.submit(self.requests[event[1]])
                elif event[0] == "call":
                    engine.call(lambda manager, fn=event[1]: fn(engine), settle=event[2])
                else:
                    engine.cancel(event[1])
            engine._drain_inbox(block=False)
            if engine._has_work:
                engine._step()
            elif step > last:
                break
        else:
            raise AssertionError("the engine did not finish its requests")
        engine._flush()
        return self.streams


def cache_state(manager: PrefixCacheManager) -> tuple:
    """What the next steps' allocations and lookups depend on: every page's owner count and kind, the prefix
    index's endpoints and the KDA checkpoints, by page id."""
    pool = manager.pool
    index = sorted((h, tuple(e.block.pages), e.hash_blocks, e.ready) for h, e in manager.index.items())
    checkpoints = sorted((k, c.num_tokens, tuple(c.pages), c.keep) for k, c in manager.checkpoints.by_key.items())
    return tuple(pool.refcount), tuple(pool.kind), pool.num_cached, index, checkpoints


# The look-ahead's batches hold the rows of requests that just stopped (run on scratch): other rows' GEMMs see
# another batch size, which moves their float32 values by ulps on the CPU (not batch-invariant below ~4
# rows); one extra step of a request moves its state by far more (test_decode_lookahead checks it does).
LOOKAHEAD_STATE_ATOL = 1e-4


def state_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| of two requests' KDA state pages (bytes), read as float32 (the harness's state and conv
    dtypes: nano in float32)."""
    return (a.contiguous().view(torch.float32) - b.contiguous().view(torch.float32)).abs().max().item()


def _same_state(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if not atol:
        return torch.equal(a, b)
    return state_difference(a, b) <= atol


def batch_noise_floor(model, script: dict, fillers: int = 3, **engine_args) -> float:
    """How far the device's own arithmetic moves the states of `script`'s requests when only the batches
    around them change: the plain engine on `script`, and again with `fillers` more requests (other prompts,
    arriving with the first ones, outliving them); the largest state difference of a request when it left.
    The look-ahead's batches differ from the plain ones in that way only (a stopped row stays in the batch
    one step more, on scratch), so its states may differ from the plain engine's by that much, not more."""
    vocab = model.config.vocab_size
    extra = [("add", f"filler{j}", prompt(40 + j, 11 + 3 * j), options(vocab, max_tokens=16, ignore_eos=True))
             for j in range(fillers)]
    alone, joined = ScriptedEngine(model, False, **engine_args), ScriptedEngine(model, False, **engine_args)
    want = alone.run(script)
    got = joined.run({**script, 0: script.get(0, []) + extra})
    for rid in want:  # the same tokens, so the same computation on other batches
        assert got[rid].tokens == want[rid].tokens, f"{rid}: the fillers changed its stream"
    return max(state_difference(joined.finished_state[rid], state) for rid, state in alone.finished_state.items())


def compare_with_plain(model, script: dict, watch=None, *, lookahead: bool = False, state_atol: float | None = None,
                       **engine_args) -> tuple[ScriptedEngine, ScriptedEngine]:
    """Run `script` on the plain engine and on the overlapped one (with the look-ahead if asked): the streams,
    the states (bit for bit; with the look-ahead within `state_atol`, LOOKAHEAD_STATE_ATOL if None) and page
    ids of the requests when they leave, and the cache's end state must be the same."""
    plain = ScriptedEngine(model, False, **engine_args)
    overlap = ScriptedEngine(model, True, lookahead=lookahead, **engine_args)
    if watch is not None:
        watch(plain), watch(overlap)
    want, got = plain.run(script), overlap.run(script)
    assert want.keys() == got.keys()
    for rid in want:
        a, b = want[rid], got[rid]
        assert (b.tokens, b.text, b.reason, b.error) == (a.tokens, a.text, a.reason, a.error), rid
    assert overlap.computed.keys() == plain.computed.keys()
    for rid, state in plain.finished_state.items():
        assert (overlap.computed[rid], overlap.pages[rid]) == (plain.computed[rid], plain.pages[rid]), rid
        atol = (LOOKAHEAD_STATE_ATOL if state_atol is None else state_atol) if lookahead else 0
        assert _same_state(overlap.finished_state[rid], state, atol), \
            f"{rid}: KDA state differs when it left (by {state_difference(overlap.finished_state[rid], state):.3g})"
    assert cache_state(overlap.manager) == cache_state(plain.manager)
    assert plain.overlapped == 0
    return plain, overlap
