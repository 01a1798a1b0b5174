"""What the prefill and decode servers share: the worker's lifecycle on the service runtime and the
validation that turns a proto request into an engine request."""

from __future__ import annotations

import asyncio
import logging

from k3.v1 import common_pb2
from services.engine.config import WorkerConfig
from services.engine.engine import Engine
from services.engine.params import GenerationOptions, check_prompt
from services.engine.peers import TransferDirectory
from services.engine.request import EngineRequest
from services.engine.streams import RequestStream
from services.engine.weight_reload import WeightReloader, start_weight_reload
from services.engine.worker import Worker
from services.kvtransfer.relayout import rank_layout
from services.runtime import ServiceApp, errors

log = logging.getLogger("k3.worker")


class WorkerService:
    """Owns the Worker of a server; its engine exists once the app's on_start hook ran."""

    def __init__(self, app: ServiceApp, config: WorkerConfig, role: str):
        self.app = app
        self.config = config
        self.role = role
        self.worker = Worker(config, role)
        self.transfers = TransferDirectory(config)
        self.model_config = config.model_config()
        self._engine: Engine | None = None
        self.reloader: WeightReloader | None = None  # follows the trainer's published weights
        app.meta.update(model=config.model, tp_size=config.tp_size, hash_block_tokens=config.hash_block_tokens,
                        kda_heads=self.model_config.kda_num_heads, num_pages=config.num_pages)
        app.on_start(self._start)
        app.on_stop(self._stop)

    @property
    def engine(self) -> Engine:
        if self._engine is None or not self._engine.alive:
            raise errors.Unavailable("the worker's engine is not running", retry_after_ms=1000)
        return self._engine

    @property
    def layout(self) -> common_pb2.TensorParallelLayout:
        return rank_layout(self.model_config.kda_num_heads, self.config.tp_size, 0)

    def instance_id(self) -> common_pb2.InstanceId:
        return common_pb2.InstanceId(service=self.role, cluster=self.config.cluster, instance=self.app.instance,
                                     address=self.app.address)

    async def _start(self) -> None:
        self._engine = await asyncio.to_thread(self.worker.start, self.instance_id())
        self.reloader = await asyncio.to_thread(start_weight_reload, self._engine, self.config, self.role)
        asyncio.get_running_loop().create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """A worker whose engine (or a TP rank) died stops serving so that it gets replaced."""
        while self._engine is not None and self._engine.alive:
            await asyncio.sleep(0.5)
        if self._engine is not None and self._engine.failure is not None:
            log.error("engine failed; shutting the worker down", extra={"error": str(self._engine.failure)})
            self.app.request_stop()

    async def _stop(self) -> None:
        if self.reloader is not None:
            await asyncio.to_thread(self.reloader.close)
        await asyncio.to_thread(self.worker.stop)
        self.transfers.close()

    def load(self) -> common_pb2.WorkerLoad:
        engine = self.engine
        return common_pb2.WorkerLoad(instance=self.instance_id(), running=len(engine.scheduler.running),
                                     waiting=len(engine.scheduler.waiting), pool_usage=engine.pool_usage(),
                                     tokens_per_second=engine.metrics.current_tokens_per_second)

    def new_request(self, rid: str, prompt: list[int], sampling: common_pb2.SamplingParams,
                    model: str, **extra) -> tuple[EngineRequest, RequestStream]:
        if not rid:
            raise errors.InvalidArgument("request_id", "must be set")
        if model and model != self.config.model:
            raise errors.InvalidArgument("model", f"this worker serves {self.config.model!r}, not {model!r}")
        vocab = self.model_config.vocab_size
        check_prompt(prompt, vocab, self.config.max_model_len)
        options = GenerationOptions.from_proto(sampling, vocab_size=vocab, max_tokens_limit=self.config.max_tokens_limit)
        if options.stop and self.worker.engine is not None and self.worker.engine.output.tokenizer is None:
            raise errors.InvalidArgument("sampling.stop", "stop strings need a tokenizer this model lacks here")
        if len(prompt) + options.max_tokens > self.config.max_model_len:
            raise errors.InvalidArgument("sampling.max_tokens", f"prompt + max_tokens exceed max_model_len "
                                         f"{self.config.max_model_len}")
        stream = RequestStream()
        return EngineRequest(rid, list(prompt), options, stream.emit, **extra), stream
