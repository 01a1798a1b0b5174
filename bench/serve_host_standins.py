"""STAND-INs for the device in bench.serve_host (no GPU here): its captured decode graphs (a replay that
does nothing, static logits) and its timeline (a replay keeps the device busy for a set time)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.engine.cuda_graphs import DecodeGraphs, _Captured
from services.engine.decode_inputs import DecodeInputBuilder


class _NoEvent:
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _NoGraph:
    def __init__(self, on_replay: Callable[[], None]) -> None:
        self.replay = on_replay


class StandInGraphs(DecodeGraphs):
    """STAND-IN for the CUDA graphs: `DecodeGraphs.staging` / `launch` themselves run (the staging buffer
    filled, copied to the input buffer, replayed), but the replay is a no-op and the logits a static
    [bucket, vocab] bf16 tensor."""

    def __init__(self, builder: DecodeInputBuilder, buckets: tuple[int, ...], vocab: int,
                 on_replay: Callable[[], None]) -> None:
        self.builder, self.buckets, self.vocab, self._graphs = builder, buckets, vocab, {}
        self.on_replay = on_replay
        self.device = torch.device("cpu")

    def _get(self, size: int) -> _Captured:
        if size not in self._graphs:
            host = torch.empty(self.builder.numel(size), dtype=torch.int64)
            logits = torch.randn(size, self.vocab, generator=torch.Generator().manual_seed(size)).bfloat16()
            self._graphs[size] = _Captured(_NoGraph(self.on_replay), torch.empty_like(host), host, _NoEvent(), logits)  # type: ignore[arg-type]
        return self._graphs[size]


class DeviceClock:
    """STAND-IN for the GPU's timeline (`--replay-ms`): a replay keeps the device busy for `replay_s` after
    the later of its launch and the previous replay's end, and a step's tokens are on the host once the
    device is done (the engine thread sleeps until then, releasing the GIL as a CUDA event wait does). What
    it measures is the device's idle per step: from the end of one replay to the launch of the next, i.e.
    the host's critical path plus the engine thread's wake-up (the GIL taken back from the streams' thread)."""

    def __init__(self, replay_s: float) -> None:
        self.replay_s = replay_s
        self.busy_until = 0.0
        self.idle = 0.0  # added up since the caller last reset it
        self.late = 0.0  # the part of it between the device's end and the engine thread running again

    def replayed(self) -> None:
        now = time.perf_counter()
        if self.busy_until:
            self.idle += max(0.0, now - self.busy_until)
        self.busy_until = max(now, self.busy_until) + self.replay_s

    SPIN_S = 3e-4  # the last part of a wait spins: a sleep's own wake-up (~0.1 ms here) would dominate `late`

    def wait(self) -> None:
        """Until the device is done: a sleep, then a spin that releases the GIL at every turn (CUDA's event
        wait spins in C with the GIL released), so `late` is what the host adds: taking the GIL back."""
        left = self.busy_until - time.perf_counter()
        if left > 0:
            if left > self.SPIN_S:
                time.sleep(left - self.SPIN_S)
            while time.perf_counter() < self.busy_until:
                time.sleep(0)
            self.late += time.perf_counter() - self.busy_until
