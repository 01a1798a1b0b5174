"""A handle that cannot be imported fails only its own request, on every TP rank alike: the decode worker
(TP 2, real processes) answers UNAVAILABLE and keeps serving the next handle in lockstep."""

from __future__ import annotations

import grpc
import pytest

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.runtime.client import aio_channel
from tests.workers.client import generate, prefill_then_decode


async def test_unknown_handle_fails_its_request_and_the_worker_goes_on(workers):
    decode = workers["decode", 2].address
    prompt = list(range(20, 45))
    sampling = common_pb2.SamplingParams(max_tokens=5, ignore_eos=True)
    async with aio_channel(decode) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
            request_id="no-such-handle", prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling,
            handle=common_pb2.KVHandle(handle_id="never-pushed"), first_token=7), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stream:
                pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "import" in failed.value.details()
    tokens, _ = await prefill_then_decode(workers["prefill", 2].address, decode, "after-failure", prompt, sampling)
    local = await generate(decode, "after-failure-local", prompt, sampling)
    assert tokens == [t for chunk in local for t in chunk.token_ids]  # 2 -> 2 import equals a local prefill
