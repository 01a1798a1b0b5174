"""Where the rollout driver generates: a decode worker's token-level gRPC API (Generate streams token ids
for token-id prompts, Cancel ends a paused request, GetDecodeLoad feeds the auto-throttle) and its metrics
endpoint for the weight version it serves (`k3_decode_weights_version`).

The gateway is not used yet: its CompleteRequest takes text (a paused trajectory resumes from token ids
that need not be valid UTF-8); see docs/trainer.md.
"""

from __future__ import annotations

import asyncio
import time

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.runtime.client import aio_channel
from services.runtime.metrics_scrape import scrape
from services.trainer.throttle import EngineSignals

VERSION_METRIC = "k3_decode_weights_version"


class DecodeBackend:
    def __init__(self, address: str, metrics_address: str, model: str = "", token: str = ""):
        self.channel = aio_channel(address, token)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.metrics_address = metrics_address
        self.model = model

    async def generate(self, rid: str, tokens: list[int], sampling: common_pb2.SamplingParams,
                       out: list[int], logprobs: list[float] | None = None) -> int:
        """Stream a continuation of `tokens` into `out` (kept if the task is cancelled: a pause), and the
        worker's per-token log-probs into `logprobs` when given (sampling.logprobs set); returns the finish
        reason."""
        call = self.stub.Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt=common_pb2.TokenIds(ids=tokens), sampling=sampling, model=self.model))
        try:
            async for reply in call:
                out.extend(reply.chunk.token_ids)
                if logprobs is not None:
                    logprobs.extend(lp.logprob for lp in reply.chunk.logprobs)
                if reply.chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    return reply.chunk.finish_reason
        finally:
            call.cancel()  # a paused (cancelled) task ends its request on the worker at once
        raise ConnectionError(f"request {rid}: the stream ended without a finish reason")

    async def signals(self) -> EngineSignals:
        load = (await self.stub.GetDecodeLoad(decode_pb2.GetDecodeLoadRequest(), timeout=10)).load
        return EngineSignals(running=load.running, waiting=load.waiting, kv_usage=load.pool_usage)

    def served_version(self) -> int:
        """The weight version the worker serves (0 before its first swap exports one); ScrapeFailed (an
        OSError) when its metrics endpoint cannot be read."""
        return int(scrape(self.metrics_address, timeout=10).get(VERSION_METRIC, default=0.0))

    async def wait_version(self, version: int, timeout: float = 120.0) -> None:
        """Until the worker serves `version` (it swaps once idle; the driver is paused meanwhile)."""
        deadline = time.monotonic() + timeout
        while await asyncio.to_thread(self.served_version) < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not start serving weight version {version} in {timeout}s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.channel.close()
