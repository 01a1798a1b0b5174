"""The draw in the decode graph (K3_DECODE_DRAW_IN_GRAPH=1, services/engine/decode_fastpath.py): the step's
forward ends with the greedy argmax of its logits written into the fast path's `drawn` buffer, and a decode
overlap's draw takes those tokens (`DecodeFastPath.drawn_argmax`) instead of launching the argmax after the
forward; a draw of greedy rows alone publishes nothing (the look-ahead's next step reads `drawn` as written).

Oracle: the same engine with the switch off (today's draw: `sample_rows_async`'s own argmax, then the publish
copy), on the same script: every stream, every request's KDA state bytes and page ids when it leaves, the cache's
end state and the pipeline's step modes and fallbacks must be equal, bit for bit (the same kernels on the same
logits in the same batches). On the CPU the fast path runs eagerly, the forward's argmax the same call the CUDA
graph captures; the gpu-marked case runs it captured.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from services.engine import decode_fastpath
from services.engine.decode_fastpath import DRAW_ENV, OVERLAP_ENV, draw_in_graph_wanted
from services.engine.metrics import counts_since
from tests.workers.overlap_harness import ScriptedEngine, cache_state, harness_model, options, prompt
from tests.workers.test_decode_overlap_staging import StagedGraphs


@pytest.fixture(scope="module")
def nano():
    return harness_model()


def _script(vocab: int, probe: dict) -> dict:
    """Greedy rows (one stops on a stop id, one on max_tokens), a sampled row arriving mid-stream (mixed
    steps: the forward's argmax for the greedy rows, the Gumbel draw after the graph), a cancellation."""
    greedy = options(vocab, max_tokens=12, ignore_eos=True)
    return {0: [("add", "g0", prompt(0, 9), options(vocab, max_tokens=12, stop_token_ids=[probe["g0"].tokens[5]],
                                                      ignore_eos=True)),
                ("add", "g1", prompt(1, 30), greedy),
                ("add", "g2", prompt(2, 17), options(vocab, max_tokens=7, ignore_eos=True))],
            4: [("add", "s", prompt(3, 12), options(vocab, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True))],
            11: [("add", "g3", prompt(4, 5), greedy)],
            13: [("cancel", "g1")]}


def _run(model, monkeypatch, in_graph: bool, device: str = "cpu", staged: bool = False, **engine_args):
    """A look-ahead engine with the switch set, run on `_script` (`staged`: in the CPU stand-in of the CUDA
    graphs, test_decode_overlap_staging.StagedGraphs): (the engine, its streams, its pipeline counts, draws
    that took the forward's argmax, publishes)."""
    monkeypatch.setenv(DRAW_ENV, "1" if in_graph else "0")
    probe = ScriptedEngine(model, False, device=device).run({0: [
        ("add", "g0", prompt(0, 9), options(model.config.vocab_size, max_tokens=12, ignore_eos=True))]})
    scripted = ScriptedEngine(model, True, lookahead=True, device=device, **engine_args)
    fast = scripted.engine.executor.fastpath
    assert fast.draw_in_graph is in_graph
    if staged:
        fast.graphs = scripted.graphs = StagedGraphs(scripted, (1, 2, 4, 8), "0")
    calls = {"taken": 0, "published": 0}
    drawn_argmax, publish = fast.drawn_argmax, fast.publish

    def counted_argmax(logits: torch.Tensor) -> torch.Tensor | None:
        got = drawn_argmax(logits)
        calls["taken"] += got is not None
        return got

    def counted_publish(tokens: torch.Tensor) -> None:
        calls["published"] += 1
        publish(tokens)
    fast.drawn_argmax, fast.publish = counted_argmax, counted_publish
    before = scripted.engine.metrics.pipeline.counts()
    streams = scripted.run(_script(model.config.vocab_size, probe))
    counts = counts_since(before, scripted.engine.metrics.pipeline.counts())
    return scripted, streams, counts, calls["taken"], calls["published"]


def _assert_same(today, in_graph) -> None:
    (a, want, counts_a, _, _), (b, got, counts_b, _, _) = today, in_graph
    assert want.keys() == got.keys()
    for rid in want:
        assert (got[rid].tokens, got[rid].text, got[rid].reason) == (want[rid].tokens, want[rid].text,
                                                                    want[rid].reason), rid
        assert torch.equal(b.finished_state[rid], a.finished_state[rid]), f"{rid}: KDA state bytes differ"
        assert (b.computed[rid], b.pages[rid]) == (a.computed[rid], a.pages[rid]), rid
    assert cache_state(b.manager) == cache_state(a.manager)
    assert counts_b == counts_a and (a.overlapped, a.ahead) == (b.overlapped, b.ahead)


def test_the_switch_is_on_by_default_and_only_where_the_overlap_draws(monkeypatch):
    monkeypatch.delenv(DRAW_ENV, raising=False)
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert draw_in_graph_wanted(sharded=False)
    monkeypatch.setenv(DRAW_ENV, "0")
    assert not draw_in_graph_wanted(sharded=False)
    monkeypatch.setenv(DRAW_ENV, "1")
    assert not draw_in_graph_wanted(sharded=True) and not draw_in_graph_wanted(sharded=False, speculative=True)
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not draw_in_graph_wanted(sharded=False)


def test_rebuild_reads_the_switch_again(nano, monkeypatch):
    # bench.serve's variants flip the switch in one process (`apply_variant` -> `rebuild`): the forward and the
    # graphs' warm-up protection follow it.
    monkeypatch.setenv(DRAW_ENV, "0")
    fast = ScriptedEngine(nano, True, lookahead=True).engine.executor.fastpath
    assert not fast.draw_in_graph and fast.graph_outputs() == ()
    monkeypatch.setenv(DRAW_ENV, "1")
    fast.rebuild()
    assert fast.draw_in_graph and fast.graph_outputs() == (fast.drawn,)


def test_the_forwards_argmax_gives_todays_tokens_states_and_pipeline(nano, monkeypatch):
    today, in_graph = _run(nano, monkeypatch, False), _run(nano, monkeypatch, True)
    _assert_same(today, in_graph)
    steps = in_graph[2]["steps"]
    assert steps.get("lookahead", 0) >= 5 and steps.get("plain", 0) >= 1  # every mode ran
    assert today[3] == 0 and in_graph[3] >= 10  # the draws took the forward's argmax
    # all-greedy look-ahead draws publish nothing; the mixed ones (the sampled row) and today's all do
    assert in_graph[4] < today[4] and in_graph[4] > 0


def test_the_draw_takes_the_forwards_argmax_only_for_the_last_launchs_logits(nano, monkeypatch):
    scripted, _, _, _, _ = _run(nano, monkeypatch, True)
    fast = scripted.engine.executor.fastpath
    logits = fast._launched
    assert logits is not None
    got = fast.drawn_argmax(logits)
    assert torch.equal(got, logits.argmax(-1)) and torch.equal(got, fast.drawn[: len(logits)])
    assert fast.drawn_argmax(logits.clone()) is None  # another tensor's (a float copy, another forward's)
    fast.draw_in_graph = False
    assert fast.drawn_argmax(logits) is None


def test_a_bucket_first_used_by_a_look_ahead_step_leaves_the_draw_it_reads(nano, monkeypatch):
    # A bucket's graph is made (its forward warmed up for real, writing `drawn`) when first used: here 5 rows,
    # then 4 and 2 after rows leave, between a draw and the look-ahead launch reading it (`DecodeGraphs.preserving`).
    first_use: list[tuple[int, bool]] = []  # (bucket, a look-ahead launch) of each graph made
    get = StagedGraphs._get

    def made(self: StagedGraphs, size: int):
        if size not in self._graphs:
            first_use.append((size, any(f.function == "advance" and "lookahead" in f.filename for f in inspect.stack())))
        return get(self, size)
    monkeypatch.setattr(StagedGraphs, "_get", made)
    today = _run(nano, monkeypatch, False, staged=True)
    first_use.clear()
    in_graph = _run(nano, monkeypatch, True, staged=True)
    _assert_same(today, in_graph)
    assert any(ahead for _, ahead in first_use), first_use
    assert not in_graph[0].graphs.hazards


def test_the_oracle_fails_when_the_forwards_argmax_is_wrong(nano, monkeypatch):
    # The tokens do come from the forward's argmax: one that writes the next column instead changes the streams.
    argmax = decode_fastpath.dispatch.greedy_argmax

    def shifted(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        got = argmax(logits, out=out)
        return got.add_(1).remainder_(logits.shape[-1])
    today = _run(nano, monkeypatch, False)
    # the fast path's forward alone (the sampler's own argmax, the plain steps', stays right)
    monkeypatch.setattr(decode_fastpath, "dispatch", SimpleNamespace(greedy_argmax=shifted))
    with pytest.raises(AssertionError):
        _assert_same(today, _run(nano, monkeypatch, True))


@pytest.mark.gpu
def test_captured_draw_gives_todays_tokens_and_pool_bytes_on_the_gpu(nano, monkeypatch):
    """The same on CUDA: the argmax captured in each bucket's graph, the look-ahead's prologue reading it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    today, in_graph = _run(nano, monkeypatch, False, "cuda"), _run(nano, monkeypatch, True, "cuda")
    assert in_graph[0].engine.executor.fastpath.graphs is not None
    _assert_same(today, in_graph)
    assert in_graph[3] >= 10 and in_graph[4] < today[4]


def test_preserving_restores_the_graph_outputs_when_the_block_raises():
    """A warm-up that fails half-way (after writing the draw's outputs) must not leave them overwritten."""
    from services.engine.cuda_graphs import DecodeGraphs

    drawn = torch.tensor([7, 8, 9])
    graphs = SimpleNamespace(preserve=[drawn])
    with pytest.raises(RuntimeError, match="warm-up failed"):
        with DecodeGraphs.preserving(graphs):
            drawn.fill_(0)
            raise RuntimeError("warm-up failed")
    assert drawn.tolist() == [7, 8, 9]
