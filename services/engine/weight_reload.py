"""Workers follow the trainer's published weights: `<etcd prefix>/weights/<model>` = {version, location}.

On a newer version the reloader thread reads the checkpoint (k3core loader, strict: every tensor present
with the model's shape), then asks the engine to swap it in between two steps, on the engine thread.

When a swap happens: at the first step boundary where no request holds KV in the pool. KV (and KDA state)
computed under the old weights is wrong under the new ones, so a request in flight finishes under the
weights it started with, and the swap then evicts the whole prefix cache (GPU pool and CPU tier): after
it every cached byte was computed by the new version. Waiting requests hold nothing and start under the
new weights. Under continuous traffic the swap waits for a gap between requests; the RL driver pauses its
rollouts before it publishes, so the worker drains at once.

Reported as `k3_<role>_weights_version` (0: the weights the worker started with) and in the log.
The decode fast path stays on: its tensors derived from the weights are recomputed into their storage
(`DecodeFastPath.reload_weights`), so captured CUDA graphs keep running.
Limits: TP 1 only (ranks > 0 hold shards and follow rank 0's plans, which carry no reload).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable

import pyetcd
import torch
from prometheus_client import Gauge

from k3core.cache.manager import PrefixCacheManager
from k3core.weights.checkpoint import load_checkpoint
from services.engine.config import WorkerConfig
from services.engine.engine import Engine
from services.runtime.etcd_follow import EtcdFollower

log = logging.getLogger("k3.worker.weights")

_GAUGES: dict[str, Gauge] = {}
SWAP_POLL_S = 0.05
SYNC_TIMEOUT_S = 30.0


def weights_version_gauge(role: str) -> Gauge:
    if role not in _GAUGES:
        _GAUGES[role] = Gauge(f"k3_{role}_weights_version", "Weight version this worker serves (0: as started)")
    return _GAUGES[role]


def invalidate_prefix_cache(manager: PrefixCacheManager) -> int:
    """Drop every idle cached entry (MLA blocks, KDA checkpoints) and the whole CPU tier. Only valid when no
    request holds pages. Returns the GPU pages freed."""
    if manager.requests:
        raise RuntimeError("cannot invalidate the prefix cache while requests hold pages")
    freed = manager.evict_idle(manager.pool.num_pages)
    if manager.cpu is not None:
        for entry in [*manager.cpu.blocks(), *manager.cpu.checkpoints()]:
            manager.cpu.remove(entry)
    return freed


class WeightReloader(EtcdFollower):
    def __init__(self, engine: Engine, endpoints: list[str], prefix: str, model_name: str, role: str,
                 dtype: torch.dtype):
        super().__init__(endpoints, "weights-watch")
        self.engine = engine
        self.key = f"{prefix}/weights/{model_name}"
        self.dtype = dtype
        self.version = 0
        self.gauge = weights_version_gauge(role)
        self.gauge.set(0)
        self._start()

    def _follow(self, client: pyetcd.client) -> None:
        response = client.get_prefix_response(self.key)
        for kv in response.kvs:
            if kv.key.decode() == self.key:  # the prefix also matches longer model names
                self._apply(kv.value)
        self._mark_synced()
        for event in self._watch(client.watch, self.key, start_revision=response.header.revision + 1):
            if not isinstance(event, pyetcd.events.DeleteEvent):
                self._apply(event.value)

    def _apply(self, value: bytes) -> None:
        try:
            announced = json.loads(value)
            version, location = int(announced["version"]), str(announced["location"])
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring a malformed weights announcement", extra={"key": self.key, "error": str(exc)})
            return
        if version <= self.version:
            return
        model = self.engine.executor.runner.model
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        try:
            state = load_checkpoint(location, expected=expected, dtype=self.dtype).state_dict
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint must not take the serving worker down
            log.error("weights not loaded; serving the previous version",
                      extra={"version": version, "location": location, "error": str(exc)[:500]})
            return
        log.info("weights loaded; swapping once no request holds KV", extra={"version": version})
        try:
            swapped = self._swap_when_idle(self._swap(model, state))
        except Exception as exc:  # noqa: BLE001 - keep following; the next announcement may load
            log.error("weights swap failed", extra={"version": version, "error": str(exc)[:500]})
            return
        if swapped:
            self.version = version
            self.gauge.set(version)
            log.info("serving new weights", extra={"version": version, "location": location})

    def _swap(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Callable[[PrefixCacheManager], bool]:
        def swap(manager: PrefixCacheManager) -> bool:  # on the engine thread, between steps
            if manager.requests:
                return False
            model.load_state_dict(state, strict=True)  # in place: every view of a weight sees the new values
            fastpath = self.engine.executor.fastpath
            if fastpath is not None:  # its derived copies (stacked, cast) follow, in their captured storage
                fastpath.reload_weights()
                log.info("decode fast path refreshed to the new weights",
                         extra={"derived_tensors": len(fastpath.decoder.derived)})
            invalidate_prefix_cache(manager)
            return True
        return swap

    def _swap_when_idle(self, swap: Callable[[PrefixCacheManager], bool]) -> bool:
        while not self._stop.is_set() and self.engine.alive:
            future = self.engine.call(swap)
            while not future.done():  # queued behind a step; give up only if the engine or this thread ends
                try:
                    future.result(timeout=1.0)
                except concurrent.futures.TimeoutError:
                    if self._stop.is_set() or not self.engine.alive:
                        return False
            if future.result():
                return True
            self._stop.wait(SWAP_POLL_S)
        return False


def start_weight_reload(engine: Engine, config: WorkerConfig, role: str) -> WeightReloader | None:
    """The reloader of a worker, or None without etcd or at TP > 1. Returns once the version published
    at start is applied (or after SYNC_TIMEOUT_S)."""
    endpoints = config.etcd_endpoint_list()
    if not endpoints:
        return None
    if config.tp_size > 1:
        log.warning("published weights are not followed at TP > 1", extra={"tp_size": config.tp_size})
        return None
    reloader = WeightReloader(engine, endpoints, config.etcd_prefix, config.model, role, config.torch_dtype)
    # A worker that joins after a publish serves the published version from its first request on.
    if not reloader.wait_synced(SYNC_TIMEOUT_S):
        log.warning("published weights not read yet; serving the startup weights until they are")
    return reloader
