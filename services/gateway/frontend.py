"""Turns validated requests into token jobs and token events back into text (shared by HTTP and gRPC)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from k3.v1 import common_pb2
from k3core.chat.parser import ChannelText, ToolCallDone, XtmlStreamParser
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
    reasoning: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)
    # The workers' log-probs of token_ids (when the request asked).
    logprobs: list[common_pb2.TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Prepared:
    job: Job
    # Chat output is XTML (think / response / tools channels); completions are plain text.
    chat: bool
    thinking: bool = False
    tools: dict = dataclasses.field(default_factory=dict)


class Frontend:
    def __init__(self, pipeline: Pipeline, model: str, max_prompt_tokens: int):
        self.pipeline = pipeline
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = ByteTokenizer()

    def prepare(self, request: InferenceRequest) -> Prepared:
        turn_boundaries: list[int] = []
        thinking, tools = False, {}
        if request.messages is not None:
            try:
                rendered = render_chat(self.tokenizer, request.messages, tools=request.tools,
                                       tool_choice=request.tool_choice, response_format=request.response_format,
                                       reasoning_effort=request.reasoning_effort,
                                       thinking=request.reasoning_effort is not None)
            except (ChatTemplateError, ValueError) as exc:
                raise RequestError(400, str(exc), "messages", "invalid_value") from exc
            prompt, turn_boundaries = rendered.tokens, rendered.message_ends
            thinking, tools = rendered.thinking, rendered.tools
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
            max_tokens=request.max_tokens, stop=request.stop, logprobs=request.logprobs,
            top_logprobs=request.top_logprobs)
        job = Job(new_request_id(), common_pb2.SessionRef(session_id=request.session_id), prompt, sampling,
                  request.model, turn_boundaries)
        return Prepared(job, request.messages is not None, thinking, tools)

    async def stream(self, prepared: Prepared) -> AsyncIterator[Delta]:
        if prepared.chat:
            parser = XtmlStreamParser(self.tokenizer, thinking=prepared.thinking, tools=prepared.tools)
        else:
            decoder = StreamDecoder(self.tokenizer, skip_special=True)
        async for event in self.pipeline.run(prepared.job):
            finish = FINISH_NAMES.get(event.finish_reason)
            delta = Delta("", event.token_ids, finish, event.cluster, event.cached_tokens,
                          logprobs=event.logprobs)
            if not prepared.chat:
                delta.text = "".join(decoder.push(t) for t in event.token_ids) + (decoder.flush() if finish else "")
                yield delta
                continue
            for item in parser.feed_all(event.token_ids):
                if isinstance(item, ChannelText) and item.channel == "response":
                    delta.text += item.text
                elif isinstance(item, ChannelText):
                    delta.reasoning += item.text
                elif isinstance(item, ToolCallDone):
                    delta.tool_calls.append(item.call.to_openai())
            if finish == "stop" and parser.tool_calls:
                delta.finish_reason = "tool_calls"
            yield delta
