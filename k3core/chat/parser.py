"""Streaming parser of generated XTML tokens into think / response / tools channels (app. F).

Feed the tokens the model generates after the generation prefix (``[open]assistant[sep][open]think[sep]``
or ``...[open]response[sep]``). Model output is untrusted: malformed structure never raises, it is
recorded in ``errors`` (and on the tool call it concerns) and parsing carries on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from k3core.chat.tool_args import compact_json, decode_arg, validate_arguments
from k3core.chat.xtml import parse_header
from k3core.tokenizer.protocol import CLOSE, END_OF_MSG, EOS, OPEN, SEP, Tokenizer, UnknownTokenError
from k3core.tokenizer.streaming import StreamDecoder

# Which element may appear inside which; text is allowed only in the leaf elements.
_CHILDREN = {"assistant": {"think", "response", "tools"}, "tools": {"call"}, "call": {"arg", "json"}}
_CHANNELS = ("think", "response")
_RAW_TEXT = ("arg", "json")


@dataclass(frozen=True)
class ChannelText:
    channel: str  # "think" or "response"
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass
class ParsedToolCall:
    index: int
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def call_id(self) -> str:
        return f"functions.{self.name}:{self.index}"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": compact_json(self.arguments)},
        }


@dataclass(frozen=True)
class ToolCallDone:
    call: ParsedToolCall


@dataclass(frozen=True)
class MessageEnd:
    pass


Event = ChannelText | ToolCallStart | ToolCallDone | MessageEnd


@dataclass
class _Frame:
    tag: str
    attrs: dict[str, str]
    raw: bytearray = field(default_factory=bytearray)
    ignored: bool = False  # a misplaced element: its content is dropped


class XtmlStreamParser:
    def __init__(
        self, tokenizer: Tokenizer, *, thinking: bool, tools: dict[str, dict[str, Any]] | None = None
    ) -> None:
        self._tok = tokenizer
        specials = tokenizer.special_tokens
        self._open, self._sep, self._close = specials[OPEN], specials[SEP], specials[CLOSE]
        self._stops = {specials[END_OF_MSG], specials[EOS]}
        self._special_ids = set(specials.values())
        self._tools = tools or {}
        self._stack = [_Frame("assistant", {}), _Frame("think" if thinking else "response", {})]
        self._decoder = StreamDecoder(tokenizer)
        self._tag_bytes: bytearray | None = None  # collecting an [open]/[close] tag up to [sep]
        self._closing = False
        self.thinking = thinking
        self.channels = {"think": "", "response": ""}
        self.tool_calls: list[ParsedToolCall] = []
        self.errors: list[str] = []
        self.done = False

    def feed(self, token_id: int) -> list[Event]:
        if self.done:
            self.errors.append(f"token {token_id} after the end of the message")
            return []
        try:
            return self._feed(token_id)
        except UnknownTokenError as exc:
            # A model's embedding may be padded past the tokenizer's vocabulary; such an id is dropped (every
            # path looks its bytes up before changing any state).
            self.errors.append(str(exc))
            return []

    def _feed(self, token_id: int) -> list[Event]:
        if self._tag_bytes is not None:
            return self._feed_tag(token_id)
        if token_id == self._open or token_id == self._close:
            self._tag_bytes, self._closing = bytearray(), token_id == self._close
            return self._flush_channel()
        if token_id in self._stops:
            return self._end()
        if token_id in self._special_ids:
            self.errors.append(f"unexpected special token {self._tok.token_bytes(token_id).decode()!r}")
            return []
        return self._text(token_id)

    def feed_all(self, token_ids: list[int]) -> list[Event]:
        return [event for t in token_ids for event in self.feed(t)]

    def message(self) -> dict[str, Any]:
        """The OpenAI-style assistant message parsed so far."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.channels["response"]}
        if self.thinking:
            msg["reasoning_content"] = self.channels["think"]
        if self.tool_calls:
            msg["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return msg

    # -- text ---------------------------------------------------------------------------------------

    def _text(self, token_id: int) -> list[Event]:
        top = self._stack[-1]
        if top.ignored:
            return []
        if top.tag in _RAW_TEXT:
            top.raw += self._tok.token_bytes(token_id)
            return []
        if top.tag in _CHANNELS:
            return self._emit(top.tag, self._decoder.push(token_id))
        self.errors.append(f"text directly inside <{top.tag}> dropped")
        return []

    def _emit(self, channel: str, text: str) -> list[Event]:
        if not text:
            return []
        self.channels[channel] += text
        return [ChannelText(channel, text)]

    def _flush_channel(self) -> list[Event]:
        top = self._stack[-1]
        tail = self._decoder.flush()
        return self._emit(top.tag, tail) if top.tag in _CHANNELS and not top.ignored else []

    # -- structure ------------------------------------------------------------------------------------

    def _feed_tag(self, token_id: int) -> list[Event]:
        assert self._tag_bytes is not None
        if token_id != self._sep:
            if token_id in self._special_ids:
                self.errors.append("special token inside an element tag")
                self._tag_bytes = None
                return []
            self._tag_bytes += self._tok.token_bytes(token_id)
            return []
        header = self._tag_bytes.decode("utf-8", errors="replace")
        self._tag_bytes = None
        return self._close_element(header) if self._closing else self._open_element(header)

    def _open_element(self, header: str) -> list[Event]:
        parent = self._stack[-1]
        try:
            tag, attrs = parse_header(header)
        except ValueError as exc:
            self.errors.append(str(exc))
            tag, attrs = header.split(" ", 1)[0], {}
        frame = _Frame(tag, attrs, ignored=parent.ignored)
        self._stack.append(frame)
        if frame.ignored:
            return []
        if tag not in _CHILDREN.get(parent.tag, set()):
            self.errors.append(f"<{tag}> is not allowed inside <{parent.tag}>")
            frame.ignored = True
            return []
        if tag == "call":
            return [self._start_call(attrs)]
        return []

    def _start_call(self, attrs: dict[str, str]) -> ToolCallStart:
        call = ParsedToolCall(index=len(self.tool_calls), name=attrs.get("tool", ""))
        if attrs.get("index") != str(call.index):
            call.errors.append(f"call index {attrs.get('index')!r}, expected {call.index}")
        if not call.name:
            call.errors.append("call without a tool name")
        elif self._tools and call.name not in self._tools:
            call.errors.append(f"tool {call.name!r} is not declared")
        self.tool_calls.append(call)
        return ToolCallStart(call.index, call.name)

    def _close_element(self, tag: str) -> list[Event]:
        if len(self._stack) == 1 or self._stack[-1].tag != tag:
            self.errors.append(f"[close]{tag} does not match the open <{self._stack[-1].tag}>")
            return []
        frame = self._stack.pop()
        if frame.ignored:
            return []
        if frame.tag in _RAW_TEXT:
            self._finish_arg(frame)
        elif frame.tag == "call":
            call = self.tool_calls[-1]
            parameters = self._tools.get(call.name, {}).get("parameters")
            call.errors.extend(validate_arguments(call.arguments, parameters))
            return [ToolCallDone(call)]
        return []

    def _finish_arg(self, frame: _Frame) -> None:
        call = self.tool_calls[-1]
        text = frame.raw.decode("utf-8", errors="replace")
        if frame.tag == "json":
            try:
                value = json.loads(text)
                if not isinstance(value, dict):
                    raise ValueError("not an object")
                call.arguments.update(value)
            except ValueError as exc:
                call.errors.append(f"json arguments block: {exc}")
            return
        name = frame.attrs.get("name")
        if not name:
            call.errors.append("argument without a name")
            return
        if name in call.arguments:
            call.errors.append(f"argument {name!r} given twice")
        properties = (self._tools.get(call.name, {}).get("parameters") or {}).get("properties") or {}
        try:
            call.arguments[name] = decode_arg(text, frame.attrs, properties.get(name))
        except ValueError as exc:
            call.errors.append(f"argument {name!r}: {exc}")

    def _end(self) -> list[Event]:
        events = self._flush_channel()
        open_tags = [f.tag for f in self._stack[1:] if f.tag not in _CHANNELS]
        if self._tag_bytes is not None or open_tags:
            self.errors.append(f"message ended inside {open_tags or 'an element tag'}")
        self.done = True
        return [*events, MessageEnd()]


def parse_assistant(
    tokenizer: Tokenizer, token_ids: list[int], *, thinking: bool, tools: dict[str, dict[str, Any]] | None = None
) -> XtmlStreamParser:
    """Non-streaming convenience: parse a whole generated message."""
    parser = XtmlStreamParser(tokenizer, thinking=thinking, tools=tools)
    parser.feed_all(token_ids)
    return parser
