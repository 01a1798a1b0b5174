"""Plain gRPC clients of the workers, as the gateway drives them."""

from __future__ import annotations

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.runtime.client import aio_channel


async def prefill_then_decode(prefill: str, decode: str, rid: str, prompt: list[int],
                              sampling: common_pb2.SamplingParams) -> tuple[list[int], prefill_pb2.PrefillResponse]:
    """The disaggregated path: prefill (pages pushed to the transfer service), then decode from the handle."""
    async with aio_channel(prefill) as channel:
        result = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling), timeout=120)
    tokens: list[int] = []
    async with aio_channel(decode) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
            request_id=rid, prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling, handle=result.handle,
            first_token=result.first_token), timeout=120)
        async for reply in stream:
            tokens += reply.chunk.token_ids
    return tokens, result


async def generate(decode: str, rid: str, prompt: list[int], sampling: common_pb2.SamplingParams
                   ) -> list[common_pb2.TokenChunk]:
    async with aio_channel(decode) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling), timeout=120)
        return [reply.chunk async for reply in stream]


async def decode_load(decode: str) -> common_pb2.WorkerLoad:
    async with aio_channel(decode) as channel:
        reply = await decode_pb2_grpc.DecodeServiceStub(channel).GetDecodeLoad(
            decode_pb2.GetDecodeLoadRequest(), timeout=10)
    return reply.load
