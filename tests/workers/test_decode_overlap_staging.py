"""The decode overlap with the CUDA graphs' host side: one staging image per batch bucket, reused every step.

On CPU the fast path builds each step into a fresh array, so the overlap's writes into a staging image that
a launched step was copied from (the tokens through `token_slots`, `compact` in place, the next
step's `prepare`) are never exercised by test_decode_overlap.py. Here a STAND-IN for `DecodeGraphs` runs
the real `staging` / `launch` (bucket padding, one pinned-like image per bucket) with the eager forward
as its "replay", and its copy-landed event checks the ordering rule of a non-blocking copy: nothing writes
a bucket's image between its launch and the next `staging` of that bucket (the event's synchronize), else
the device could read half-overwritten inputs; and each "replay" must find its device inputs equal to the
staging image it was launched with (a launch that skips the copy fails there, though the plain loop on the
same stand-in would share its garbage). The three forms of the copy (K3_GRAPH_INPUT_COPY): outside the
graph (`launch` copies and records), inside it (the "replay" copies and records first, as the captured
copy and event-record nodes do), and by image size (both forms in one run, compaction crossing them). Oracle: the plain loop's streams, pages and states
(`compare_with_plain`), both engines on the stand-in so that the forwards' shapes are the same.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import cuda_graphs
from services.engine.cuda_graphs import DecodeGraphs, _Captured, copies_inside
from tests.workers.overlap_harness import ScriptedEngine, compare_with_plain, options, prompt
from tests.workers.test_decode_overlap import nano  # noqa: F401 - the module fixture


class _CopyLanded:
    """STAND-IN for the copy's CUDA event: `record` at the launch, `synchronize` before the image is reused."""

    def __init__(self, host: torch.Tensor, hazards: list[str]) -> None:
        self.host, self.hazards, self.launched = host, hazards, None

    def record(self) -> None:
        self.synchronize()  # written since the previous launch without a `staging` in between: a hazard too
        self.launched = self.host.clone()

    def synchronize(self) -> None:
        if self.launched is not None and not torch.equal(self.host, self.launched):
            self.hazards.append("a staging image was written while its copy to the device could be in flight")
        self.launched = None


class _Replay:
    def __init__(self, run) -> None:
        self.replay = run


class StagedGraphs(DecodeGraphs):
    """STAND-IN for the CUDA graphs on CPU: `DecodeGraphs.staging` / `launch` as they are; a bucket's
    "graph" is the eager forward over its device-side inputs, into a static logits tensor."""

    def __init__(self, scripted: ScriptedEngine, buckets: tuple[int, ...], setting: str) -> None:
        fast = scripted.engine.executor.fastpath
        self.forward, self.builder, self.device = fast._forward, fast.builder, torch.device("cpu")  # what a graph captures
        self.copy_setting = setting
        self.preserve = scripted.engine.executor.fastpath.graph_outputs()
        self.buckets, self._graphs, self.hazards = sorted(buckets), {}, []
        self.launches: list[int] = []  # bucket of each launch
        self.inside: dict[int, bool] = {}  # bucket -> its graph copies its staging image

    def _get(self, size: int) -> _Captured:
        if size not in self._graphs:
            host = torch.empty(self.builder.numel(size), dtype=torch.int64)
            self.builder.build([], [], size, out=host.numpy())  # every row on the scratch pages
            device_inputs = host.clone()
            inputs = self.builder.view(device_inputs, size)
            with self.preserving():  # as `_get`'s warm-up
                logits = self.forward(inputs).clone()
            copied = _CopyLanded(host, self.hazards)
            inside = copies_inside(host.nbytes, self.copy_setting)  # as `_get` decides

            def run() -> None:
                if inside:  # the graph's first nodes: the staging copy, then its event
                    device_inputs.copy_(host)
                    copied.record()
                if not torch.equal(device_inputs, host):  # the copy (launch's or the graph's) did not run
                    self.hazards.append("a replay read device inputs other than its launched staging image")
                self.launches.append(size)
                logits.copy_(self.forward(inputs))
            self._graphs[size] = _Captured(_Replay(run), device_inputs, host, copied, logits,  # type: ignore[arg-type]
                                           inside)
            self.inside[size] = inside
        return self._graphs[size]


def _staged(setting: str):
    def watch(scripted: ScriptedEngine) -> None:
        if not setting:
            _threshold_between_buckets(scripted)
        graphs = StagedGraphs(scripted, (1, 2, 4, 8), setting)
        scripted.engine.executor.fastpath.graphs = scripted.graphs = graphs
    return watch


def _check(plain: ScriptedEngine, overlap: ScriptedEngine, setting: str) -> None:
    assert overlap.overlapped > 0
    for scripted in (plain, overlap):
        graphs = scripted.graphs
        assert graphs.launches and not graphs.hazards
        forms = {graphs.inside[size] for size in graphs.launches}
        assert forms == ({True, False} if not setting else {setting == "1"})  # by size: both forms ran


@pytest.fixture(params=["0", "1", ""], ids=["copy_outside", "copy_inside", "copy_by_size"])
def copy_setting(request, monkeypatch) -> str:
    """K3_GRAPH_INPUT_COPY's forms; by size: the images of buckets 1 and 2 inside, of 4 and 8 outside (the
    threshold set between them), so compaction crosses from one form to the other."""
    monkeypatch.setattr(cuda_graphs, "IN_GRAPH_COPY_BYTES", cuda_graphs.IN_GRAPH_COPY_BYTES)
    return request.param


def _threshold_between_buckets(scripted: ScriptedEngine) -> None:
    builder = scripted.engine.executor.fastpath.builder
    cuda_graphs.IN_GRAPH_COPY_BYTES = 8 * builder.numel(2)  # int64 images: 1 and 2 rows fit, 4 do not


def test_the_copy_goes_inside_by_setting_and_size():
    limit = cuda_graphs.IN_GRAPH_COPY_BYTES
    assert copies_inside(limit, "") and not copies_inside(limit + 1, "")
    assert copies_inside(1 << 30, "1") and not copies_inside(8, "0")


def test_stops_and_block_crossings_with_reused_staging_images_give_the_plain_streams(nano, copy_setting):  # noqa: F811
    # 5 -> 4 -> 3 rows (buckets 8, 4, 4: compaction into another bucket's image and into the same one), rows
    # crossing into their second 80-token block while another stops, one sampled row
    vocab = nano.config.vocab_size
    requests = [("r0", 76, options(vocab, max_tokens=5, ignore_eos=True)),
                ("r1", 76, options(vocab, max_tokens=12, ignore_eos=True)),
                ("r2", 60, options(vocab, max_tokens=3, ignore_eos=True)),
                ("r3", 76, options(vocab, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)),
                ("r4", 9, options(vocab, max_tokens=8, ignore_eos=True))]
    script = {0: [("add", rid, prompt(i, n), o) for i, (rid, n, o) in enumerate(requests)]}
    plain, overlap = compare_with_plain(nano, script, watch=_staged(copy_setting), budget=512)
    _check(plain, overlap, copy_setting)
    assert {4, 8} <= set(overlap.graphs.launches)


def test_cancellation_and_arrivals_with_reused_staging_images(nano, copy_setting):  # noqa: F811
    vocab = nano.config.vocab_size
    greedy = options(vocab, max_tokens=10, ignore_eos=True)
    script = {0: [("add", "a", prompt(0, 6), greedy), ("add", "b", prompt(1, 20), greedy),
                  ("add", "f", prompt(4, 11), greedy)],
              2: [("add", "c", prompt(2, 3), options(vocab, temperature=0.7, seed=9, max_tokens=8))],
              4: [("cancel", "b")], 5: [("add", "d", prompt(3, 12), greedy)], 6: [("add", "e", [3], greedy)]}
    _check(*compare_with_plain(nano, script, watch=_staged(copy_setting)), copy_setting)
