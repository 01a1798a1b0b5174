"""A decode step's pulls stream while its forward computes (in-process workers, real transfer services).

The oracle of the overlap: the handle is complete on the decode side's transfer service only from inside
the forward of the step that imports it (the test opens the part before, with its first chunk, and pushes
the rest there; pages staged by a real prefill through a second service), and that forward then waits
until the service has streamed the handle out. Only a pull
already in flight during the forward can complete; one run before the forward, as it used to be, waits
for a handle that never comes and the import fails. The imported tokens must equal the offline generation."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from k3.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest, ExportTarget, ImportSource, StepOutput
from services.engine.worker import Worker
from services.kvtransfer.chunks import page_chunks
from services.kvtransfer.grpc_transport import GrpcTransport
from services.kvtransfer.relayout import rank_layout
from services.kvtransfer.transport import PulledCache
from services.runtime.client import aio_channel
from tests.workers.cluster import HASH_BLOCK, OVERRIDES
from tests.workers.oracle import build_reference, offline_generate

WAIT_S = 30.0


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()
        self.error: Exception | None = None

    def __call__(self, out: StepOutput) -> None:
        self.tokens += out.token_ids
        if out.finish_reason or out.error:
            self.error = out.error
            self.done.set()


def _worker(role: str, transfer: str) -> Worker:
    config = WorkerConfig.load(role, ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens",
                                      str(HASH_BLOCK), "--num-pages", "64", "--transfer-address", transfer], env={})
    worker = Worker(config, role)
    worker.start(common_pb2.InstanceId(service=role))
    return worker


def _greedy(max_tokens: int) -> GenerationOptions:
    return GenerationOptions.from_proto(common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                        vocab_size=300, max_tokens_limit=999)


def _bytes_out(stub: kvtransfer_pb2_grpc.KVTransferServiceStub) -> int:
    return stub.GetTransferStats(kvtransfer_pb2.GetTransferStatsRequest(), timeout=10).bytes_out


async def _pull_staged(address: str, handle_id: str) -> PulledCache:
    transport = GrpcTransport(address)
    try:
        return await transport.pull(handle_id, rank_layout(OVERRIDES["kda_num_heads"], 1, 0))
    finally:
        await transport.close()


async def _open_part(address: str, staged: PulledCache) -> None:
    """Register the handle's part with its first chunk only: held, incomplete (a producer mid-push)."""
    async with aio_channel(address) as channel:
        first = next(page_chunks(staged.handle, staged.pages))
        await kvtransfer_pb2_grpc.KVTransferServiceStub(channel).Push(iter([kvtransfer_pb2.PushRequest(chunk=first)]))


async def _push_rest(address: str, staged: PulledCache) -> None:
    transport = GrpcTransport(address)
    try:
        await transport.push(staged.handle, staged.pages)  # resumes the open part
    finally:
        await transport.close()


@pytest.fixture
def services(spawn):
    """(staging, decode side): the prefill pushes to the first, the decode worker pulls from the second."""
    return [spawn("serve", "kvtransfer", "--port", "0", "--metrics-port", "-1", "--pull-wait-s", "2",
                  name=name) for name in ("staging", "kvtransfer")]


def test_pull_streams_during_the_forward_of_its_step(services):
    staging, transfer = services
    prompt = list(range(7, 47))
    prefill, decode = _worker("prefill", staging.address), _worker("decode", transfer.address)
    channel = grpc.insecure_channel(transfer.address)
    stub = kvtransfer_pb2_grpc.KVTransferServiceStub(channel)
    try:
        first = Collector()
        prefill.engine.submit(EngineRequest("p", prompt, _greedy(1), first,
                                            export=ExportTarget("overlap", staging.address)))
        assert first.done.wait(WAIT_S) and first.error is None
        staged = asyncio.run(_pull_staged(staging.address, "overlap"))
        asyncio.run(_open_part(transfer.address, staged))
        busy = Collector()  # keeps a decode forward in every step, the import's step included
        decode.engine.submit(EngineRequest("busy", list(range(100, 120)), _greedy(400), busy))
        while len(busy.tokens) < 2:
            time.sleep(0.01)

        executor = decode.engine.executor
        execute, forward = executor.execute, executor._forward
        step: dict[str, bool] = {"imports": False}
        overlapped: list[bool] = []

        def watching_execute(plan):
            step["imports"] = bool(plan.imports)
            return execute(plan)

        def forward_waiting_for_the_pull(items):
            if step["imports"]:
                asyncio.run(_push_rest(transfer.address, staged))
                before, deadline = baseline, time.monotonic() + WAIT_S
                while _bytes_out(stub) == before and time.monotonic() < deadline:
                    time.sleep(0.01)
                overlapped.append(_bytes_out(stub) > before)
            return forward(items)

        baseline = _bytes_out(stub)
        executor.execute, executor._forward = watching_execute, forward_waiting_for_the_pull
        imported = Collector()
        decode.engine.submit(EngineRequest("d", prompt, _greedy(6), imported, forced=[first.tokens[0]],
                                           source=ImportSource("overlap", transfer.address)))
        assert imported.done.wait(WAIT_S) and imported.error is None
        assert overlapped == [True]
        assert imported.tokens == offline_generate(build_reference("nano", OVERRIDES), prompt, _greedy(6))
        decode.engine.cancel("busy")
    finally:
        channel.close()
        prefill.stop()
        decode.stop()
