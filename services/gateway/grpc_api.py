"""k3.v1.GatewayService for internal clients: the same path as the HTTP API, in protobuf."""

from __future__ import annotations

import json

from k3.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.frontend import Frontend
from services.gateway.openai_request import InferenceRequest, RequestError, derive_session_id
from services.runtime import errors


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, frontend: Frontend, max_output_tokens: int):
        self.frontend = frontend
        self.max_output_tokens = max_output_tokens

    def _request(self, request: gateway_pb2.CompleteRequest) -> InferenceRequest:
        if request.model != self.frontend.model:
            raise errors.NotFound(f"model {request.model!r} is not served here (serving {self.frontend.model!r})")
        if bool(request.messages) == bool(request.prompt):
            raise errors.InvalidArgument("messages", "give either messages or prompt")
        sampling = request.sampling
        max_tokens = sampling.max_tokens or min(256, self.max_output_tokens)
        if max_tokens > self.max_output_tokens:
            raise errors.InvalidArgument("sampling.max_tokens", f"must be <= {self.max_output_tokens}")
        if not 0 <= sampling.temperature <= 2:
            raise errors.InvalidArgument("sampling.temperature", "must be in [0, 2]")
        try:
            messages = [_message(m) for m in request.messages] or None
            parsed = InferenceRequest(
                model=request.model, stream=True, max_tokens=max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p or 1.0, top_k=sampling.top_k, seed=sampling.seed, stop=list(sampling.stop),
                messages=messages, prompt=request.prompt or None,
                tools=json.loads(request.tools_json) if request.tools_json else None,
                tool_choice=request.tool_choice or None,
                response_format=json.loads(request.response_format_json) if request.response_format_json else None,
                reasoning_effort=request.reasoning_effort or None, logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs)
        except json.JSONDecodeError as exc:
            raise errors.InvalidArgument("tools_json", f"not valid JSON: {exc.msg}") from exc
        parsed.session_id = request.session.session_id or derive_session_id(parsed)
        return parsed

    async def Complete(self, request, context):
        try:
            prepared = self.frontend.prepare(self._request(request))
        except RequestError as exc:
            raise errors.InvalidArgument(exc.param or "", exc.message) from exc
        job = prepared.job
        async for delta in self.frontend.stream(prepared):
            finish = {"stop": common_pb2.FINISH_REASON_STOP, "tool_calls": common_pb2.FINISH_REASON_STOP,
                      "length": common_pb2.FINISH_REASON_LENGTH}.get(
                delta.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
            if delta.reasoning:
                yield gateway_pb2.CompleteResponse(
                    chunk=common_pb2.TokenChunk(request_id=job.request_id, text=delta.reasoning),
                    channel="think", cluster=delta.cluster)
            yield gateway_pb2.CompleteResponse(
                chunk=common_pb2.TokenChunk(request_id=job.request_id, token_ids=delta.token_ids, text=delta.text,
                                            finish_reason=finish, logprobs=delta.logprobs),
                channel="response", cluster=delta.cluster,
                tool_calls_json=json.dumps(delta.tool_calls) if delta.tool_calls else "")

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(id=self.frontend.model)])


def _message(m: gateway_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls_json:
        out["tool_calls"] = json.loads(m.tool_calls_json)
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out
