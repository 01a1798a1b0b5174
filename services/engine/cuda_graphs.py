"""One CUDA graph of the decode forward per batch-size bucket (the batch is padded up to its bucket).

As vLLM does: a graph is captured the first time its bucket is needed, all graphs share one memory pool
(one replays at a time, and a replay's logits are consumed before the next replay, so a later graph may
reuse an earlier one's intermediates), its inputs are one static int64 buffer refreshed by a single
host-to-device copy from a pinned staging buffer, and its output is a static logits tensor valid until
the next replay. Capture
warms up on a side stream first (Triton compiles there) with every row pointing at the scratch pages, so
neither the warm-up nor the capture touches a request's state.

A small staging image is copied by the graph itself, as its first node, followed by an event-record node
(`torch.cuda.Event(external=True)`), so `staging` still waits for the copy alone, not for the forward: a
launch is then one `cudaGraphLaunch`, the host's last call before the device starts the step. On the H200
(session 6, bench.serve variants in one process) that cut the launch's share of the device's idle path from
~45 to ~12 us at 64 rows (a 22 KB image), but lengthened it by ~25 us at 256 rows (88 KB): the copy then
runs after the launch instead of during it, and slower as a graph node. So only images up to
`IN_GRAPH_COPY_BYTES` go inside; K3_GRAPH_INPUT_COPY=0 never, =1 always.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.decode_inputs import DecodeInputBuilder, DecodeInputs

COPY_ENV = "K3_GRAPH_INPUT_COPY"  # "0": the staging copy always outside the graph, "1": always inside
IN_GRAPH_COPY_BYTES = 32 << 10  # unset: images up to this size are copied inside (measured gain at 22 KB, loss at 88)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    device_inputs: torch.Tensor
    host_inputs: torch.Tensor  # pinned
    copied: torch.cuda.Event  # the staging image's copy has landed (an event-record node when in the graph)
    logits: torch.Tensor
    copy_in_graph: bool = False  # the graph's replay copies the staging image and records `copied` itself


def copies_inside(image_bytes: int, setting: str) -> bool:
    """Whether a bucket's graph copies its staging image itself (`setting`: K3_GRAPH_INPUT_COPY's value)."""
    if setting in ("0", "1"):
        return setting == "1"
    return image_bytes <= IN_GRAPH_COPY_BYTES


class DecodeGraphs:
    def __init__(self, forward: Callable[[DecodeInputs], torch.Tensor], builder: DecodeInputBuilder,
                 device: torch.device, max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 preserve: tuple[torch.Tensor, ...] = ()) -> None:
        self.forward = forward
        # what the forward writes and the next launch reads (the fast path's `drawn` with the draw in the graph):
        # a bucket's warm-up runs the forward for real, first used between a draw and the launch that reads it
        self.preserve = preserve
        self.builder = builder
        self.device = device
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _Captured] = {}
        self.copy_setting = os.environ.get(COPY_ENV, "")

    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def staging(self, batch: int) -> tuple[np.ndarray, int]:
        """The pinned host image of `batch`'s bucket and the bucket size, free to fill (its previous copy to
        the device has landed): a step may be built here while the previous one replays."""
        captured = self._get(self.bucket(batch))
        captured.copied.synchronize()
        return captured.host_inputs.numpy(), captured.logits.shape[0]

    def launch(self, batch: int) -> torch.Tensor:
        """Copy the bucket's filled staging image to the graph's inputs and replay; logits [batch, V]."""
        captured = self._get(self.bucket(batch))
        if not captured.copy_in_graph:
            captured.device_inputs.copy_(captured.host_inputs, non_blocking=True)
            captured.copied.record()
        captured.graph.replay()
        return captured.logits[:batch]

    def _get(self, size: int) -> _Captured:
        if size in self._graphs:
            return self._graphs[size]
        numel = self.builder.numel(size)
        host = torch.empty(numel, dtype=torch.int64).pin_memory()
        self.builder.build([], [], size, out=host.numpy())  # every row on the scratch pages
        device_inputs = host.to(self.device)
        inputs = self.builder.view(device_inputs, size)
        with self.preserving():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(inputs)
            torch.cuda.current_stream().wait_stream(side)
        captured = self._capture(inputs, host, copies_inside(host.nbytes, self.copy_setting))
        captured.copied.record()
        self._graphs[size] = captured
        return captured

    @contextmanager
    def preserving(self) -> Iterator[None]:
        """`preserve`'s values after the block as before it (copies queued on the current stream), also when
        the block raises (a failed warm-up must not leave live state overwritten)."""
        saved = [t.clone() for t in self.preserve]
        try:
            yield
        finally:
            for tensor, values in zip(self.preserve, saved, strict=True):
                tensor.copy_(values)

    def _capture(self, inputs: DecodeInputs, host: torch.Tensor, copy_in_graph: bool) -> _Captured:
        graph = torch.cuda.CUDAGraph()
        copied = torch.cuda.Event(external=True) if copy_in_graph else torch.cuda.Event()
        with torch.cuda.graph(graph, pool=self.pool):
            if copy_in_graph:
                inputs.flat.copy_(host, non_blocking=True)
                copied.record()
            logits = self.forward(inputs)
        return _Captured(graph, inputs.flat, host, copied, logits, copy_in_graph)
