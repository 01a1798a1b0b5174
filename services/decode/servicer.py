"""The DecodeService: colocated generation, decoding from transferred pages, cancel, probe, load."""

from __future__ import annotations

import asyncio

from k3.v1 import decode_pb2, decode_pb2_grpc
from services.engine.request import ImportSource
from services.engine.service import WorkerService
from services.engine.streams import token_chunk
from services.runtime import errors


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, service: WorkerService):
        self.service = service

    async def Generate(self, request, context):
        req, stream = self.service.new_request(
            request.request_id, list(request.prompt.ids), request.sampling, request.model,
            turn_boundaries=tuple(request.turn_boundaries))
        engine = self.service.engine
        engine.submit(req)
        async for output in stream.outputs(engine, req):
            yield decode_pb2.GenerateResponse(chunk=token_chunk(req, output))

    async def DecodeFromHandle(self, request, context):
        if not request.handle.handle_id:
            raise errors.InvalidArgument("handle.handle_id", "must be set")
        vocab = self.service.model_config.vocab_size
        if request.first_token >= vocab:
            raise errors.InvalidArgument("first_token", f"{request.first_token} outside the vocabulary ({vocab})")
        heads = request.handle.layout.total_heads
        if heads and heads != self.service.model_config.kda_num_heads:
            raise errors.FailedPrecondition(f"handle has {heads} KDA heads, this worker's model has "
                                            f"{self.service.model_config.kda_num_heads}")
        if request.sampling.logprobs and not request.HasField("first_token_logprob"):
            raise errors.InvalidArgument("first_token_logprob", "must be set when sampling.logprobs is")
        forced_logprobs = [request.first_token_logprob] if request.sampling.logprobs else []
        address = self.service.transfers.resolve(request.transfer_address)
        source = ImportSource(request.handle.handle_id, address)
        req, stream = self.service.new_request(
            request.request_id, list(request.prompt.ids), request.sampling, request.model,
            source=source, forced=[request.first_token], forced_logprobs=forced_logprobs)
        engine = self.service.engine
        engine.submit(req)
        async for output in stream.outputs(engine, req):
            yield decode_pb2.DecodeFromHandleResponse(chunk=token_chunk(req, output))

    async def Cancel(self, request, context):
        if not request.request_id:
            raise errors.InvalidArgument("request_id", "must be set")
        engine = self.service.engine
        found = request.request_id in engine.requests
        engine.cancel(request.request_id)
        return decode_pb2.CancelResponse(found=found)

    async def ProbePrefix(self, request, context):
        if request.hash_block_tokens and request.hash_block_tokens != self.service.config.hash_block_tokens:
            raise errors.InvalidArgument("hash_block_tokens", f"this worker hashes blocks of "
                                         f"{self.service.config.hash_block_tokens} tokens")
        chain = list(request.block_hashes)
        num_tokens = len(chain) * self.service.config.hash_block_tokens
        hit = await asyncio.wrap_future(self.service.engine.call(lambda m: m.lookup(chain, num_tokens),
                                                                settle=False))
        return decode_pb2.ProbePrefixResponse(hit_tokens=hit.num_tokens)

    async def GetDecodeLoad(self, request, context):
        return decode_pb2.GetDecodeLoadResponse(load=self.service.load())
