"""The PrefillService: chunked prefill (prefix cache first), pages pushed to the transfer service, first
token returned with the handle."""

from __future__ import annotations

import dataclasses
import time

from k3.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.engine.request import ExportTarget
from services.engine.scheduler import new_handle_id
from services.engine.service import WorkerService
from services.runtime import errors


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, service: WorkerService):
        self.service = service

    async def Prefill(self, request, context):
        started = time.perf_counter()
        address = self.service.transfers.resolve(request.transfer_address)
        handle_id = new_handle_id()
        req, stream = self.service.new_request(
            request.request_id, list(request.prompt.ids), request.sampling, request.model,
            turn_boundaries=tuple(request.turn_boundaries), export=ExportTarget(handle_id, address))
        # The prefill worker samples only the first token; the decode worker continues the request.
        req.options = dataclasses.replace(req.options, max_tokens=1, stop=(), stop_token_ids=frozenset(),
                                          ignore_eos=True)
        engine = self.service.engine
        engine.submit(req)
        first = first_logprob = None
        async for output in stream.outputs(engine, req):
            first = output.token_ids[0] if output.token_ids else first
            first_logprob = output.logprobs[0] if output.logprobs else first_logprob
        if first is None:
            raise errors.Internal(f"prefill of {request.request_id} ended without a token")
        config = self.service.config
        handle = common_pb2.KVHandle(handle_id=handle_id, request_id=request.request_id,
                                     producer=self.service.instance_id(), layout=self.service.layout,
                                     num_tokens=len(req.prompt), model=config.model)
        return prefill_pb2.PrefillResponse(request_id=request.request_id, first_token=first, handle=handle,
                                           prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens,
                                           prefill_ms=1e3 * (time.perf_counter() - started),
                                           first_token_logprob=first_logprob)

    async def GetPrefillLoad(self, request, context):
        return prefill_pb2.GetPrefillLoadResponse(load=self.service.load())
