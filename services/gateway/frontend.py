"""Turns validated requests into token jobs and token events back into text (shared by HTTP and gRPC)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from k3.v1 import common_pb2
from k3core.chat.render import render_chat
from k3core.chat.xtml import ChatTemplateError
from k3core.tokenizer.byte_level import ByteTokenizer
from k3core.tokenizer.streaming import StreamDecoder
from services.gateway.openai_request import InferenceRequest, RequestError
from services.gateway.pipeline import Job, Pipeline, new_request_id

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cluster: str = ""
    cached_tokens: int = 0


class Frontend:
    def __init__(self, pipeline: Pipeline, model: str, max_prompt_tokens: int):
        self.pipeline = pipeline
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = ByteTokenizer()

    def prepare(self, request: InferenceRequest) -> Job:
        turn_boundaries: list[int] = []
        if request.messages is not None:
            try:
                rendered = render_chat(self.tokenizer, request.messages, tools=request.tools,
                                       tool_choice=request.tool_choice, response_format=request.response_format,
                                       reasoning_effort=request.reasoning_effort,
                                       thinking=request.reasoning_effort is not None)
            except (ChatTemplateError, ValueError) as exc:
                raise RequestError(400, str(exc), "messages", "invalid_value") from exc
            prompt, turn_boundaries = rendered.tokens, rendered.message_ends
        else:
            prompt = self.tokenizer.encode(request.prompt or "")
        if not prompt:
            raise RequestError(400, "the prompt is empty", "prompt", "invalid_value")
        if len(prompt) > self.max_prompt_tokens:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens; this fleet accepts at most "
                               f"{self.max_prompt_tokens}", "messages" if request.messages else "prompt",
                               "context_length_exceeded")
        sampling = common_pb2.SamplingParams(
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=request.seed,
            max_tokens=request.max_tokens, stop=request.stop)
        return Job(new_request_id(), common_pb2.SessionRef(session_id=request.session_id), prompt, sampling,
                   request.model, turn_boundaries)

    async def stream(self, job: Job) -> AsyncIterator[Delta]:
        decoder = StreamDecoder(self.tokenizer, skip_special=True)
        async for event in self.pipeline.run(job):
            text = "".join(decoder.push(t) for t in event.token_ids)
            finish = FINISH_NAMES.get(event.finish_reason)
            if finish:
                text += decoder.flush()
            yield Delta(text, event.token_ids, finish, event.cluster, event.cached_tokens)
