"""The decode worker under load, cancellation, preemption, bad input and failure (real processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine.params import GenerationOptions
from services.runtime.client import aio_channel
from services.runtime.errors import error_detail
from tests.support.metrics import scrape
from tests.workers.client import decode_load, generate
from tests.workers.cluster import OVERRIDES, children, worker_args
from tests.workers.oracle import build_reference, offline_generate


async def test_64_streams_complete_and_cancelling_half_frees_their_pages(workers):
    decode = workers["decode", 1]
    cancelled = ("k3_decode_requests_finished_total", {"reason": "FINISH_REASON_CANCELLED"})
    cancelled_before = scrape(decode.info["metrics_address"]).get(*cancelled, 0.0)  # no series before the first
    prompts = [[(7 * i + j) % 250 + 1 for j in range(6 + i % 9)] for i in range(64)]
    params = [common_pb2.SamplingParams(temperature=0.8, seed=i, max_tokens=8 if i % 2 else 200, ignore_eos=True)
              for i in range(64)]
    channel = aio_channel(decode.address)
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    calls = [stub.Generate(decode_pb2.GenerateRequest(request_id=f"q{i}", prompt=common_pb2.TokenIds(ids=p),
                                                      sampling=sp), timeout=300)
             for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]

    async def consume(i: int) -> list[int]:
        tokens: list[int] = []
        async for reply in calls[i]:
            tokens += reply.chunk.token_ids
            if i % 2 == 0 and tokens:  # the even half: cancel after the first token
                if i % 4 == 0:
                    calls[i].cancel()  # client goes away
                else:
                    await stub.Cancel(decode_pb2.CancelRequest(request_id=f"q{i}"))
        return tokens

    try:
        results = await asyncio.gather(*(consume(i) for i in range(64)), return_exceptions=True)
        for i, result in enumerate(results):
            if i % 2:
                assert len(result) == 8, (i, result)
            elif i % 4 == 0:
                assert isinstance(result, asyncio.CancelledError), (i, result)
        reference = build_reference("nano", OVERRIDES)
        for i in (1, 3, 63):  # survivors equal the offline oracle
            options = GenerationOptions.from_proto(params[i], vocab_size=reference.config.vocab_size,
                                                   max_tokens_limit=1000)
            assert results[i] == offline_generate(reference, prompts[i], options)
        deadline = time.monotonic() + 10
        while (load := await decode_load(decode.address)).running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert load.running == 0 and load.waiting == 0
        assert load.pool_usage == 0.0  # back to baseline: every cancelled request's pages were freed
        metrics = scrape(decode.info["metrics_address"])
        assert metrics.value("k3_decode_pool_usage") == 0.0
        assert metrics.value(*cancelled) - cancelled_before == 32
    finally:
        await channel.close()


async def test_stop_conditions_and_bad_input(workers):
    decode = workers["decode", 1]
    prompt = list(range(60, 90))
    full = [t for c in await generate(decode.address, "full", prompt, common_pb2.SamplingParams(
        max_tokens=12, ignore_eos=True)) for t in c.token_ids]
    stop_token = await generate(decode.address, "st", prompt, common_pb2.SamplingParams(
        max_tokens=12, ignore_eos=True, stop_token_ids=[full[3]]))
    assert [t for c in stop_token for t in c.token_ids] == full[: full.index(full[3]) + 1]
    assert stop_token[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    text = bytes(t for t in full if t < 256).decode("latin-1")
    needle = text[4:6] if len(text) >= 6 else text[-2:]
    stopped = await generate(decode.address, "ss", prompt, common_pb2.SamplingParams(
        max_tokens=12, ignore_eos=True, stop=[needle]))
    assert stopped[-1].finish_reason == common_pb2.FINISH_REASON_STOP and len(stopped) < 12

    async with aio_channel(decode.address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        for bad, field in [(dict(prompt=common_pb2.TokenIds(ids=[1, 99999]), sampling=common_pb2.SamplingParams(
                max_tokens=2)), "prompt.ids"),
                           (dict(prompt=common_pb2.TokenIds(ids=[1]), sampling=common_pb2.SamplingParams()),
                            "sampling.max_tokens"),
                           (dict(prompt=common_pb2.TokenIds(ids=[1]), sampling=common_pb2.SamplingParams(
                               max_tokens=2, top_p=1.5)), "sampling.top_p"),
                           (dict(prompt=common_pb2.TokenIds(), sampling=common_pb2.SamplingParams(max_tokens=2)),
                            "prompt.ids")]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(decode_pb2.GenerateRequest(request_id="bad", **bad), timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_detail(err.value).field == field
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for _ in stub.DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
                    request_id="h", prompt=common_pb2.TokenIds(ids=[1, 2]),
                    sampling=common_pb2.SamplingParams(max_tokens=2),
                    handle=common_pb2.KVHandle(handle_id="nope"), transfer_address="127.0.0.1:1"), timeout=30):
                pass
        assert missing.value.code() == grpc.StatusCode.UNAVAILABLE  # unreachable transfer service: retriable


async def test_killing_a_tp_rank_mid_stream_gives_a_retriable_status(spawn):
    decode = spawn(*worker_args("decode", 2, "127.0.0.1:1"), name="decode")
    async with aio_channel(decode.address) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id="long", prompt=common_pb2.TokenIds(ids=list(range(1, 30))),
            sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True)), timeout=120)
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            async for reply in stream:
                received += len(reply.chunk.token_ids)
                if received == 5:
                    rank1 = children(decode.proc.pid)
                    assert len(rank1) == 1
                    os.kill(rank1[0], signal.SIGKILL)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        detail = error_detail(broken.value)
        assert detail is not None and detail.retriable and detail.retry_after_ms > 0
        assert 5 <= received < 2000
    # The worker takes itself out of service (its TP group is broken) so that it gets replaced.
    assert decode.wait(timeout=30) == 0
