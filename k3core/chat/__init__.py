"""XTML chat template (report appendix F): render requests to tokens, parse generated tokens back."""

from k3core.chat.options import REASONING_EFFORTS
from k3core.chat.parser import (
    ChannelText,
    Event,
    MessageEnd,
    ParsedToolCall,
    ToolCallDone,
    ToolCallStart,
    XtmlStreamParser,
    parse_assistant,
)
from k3core.chat.render import TOOL_DECLARE_ROLE, RenderedChat, render_chat
from k3core.chat.xtml import ChatTemplateError

__all__ = [
    "REASONING_EFFORTS",
    "TOOL_DECLARE_ROLE",
    "ChannelText",
    "ChatTemplateError",
    "Event",
    "MessageEnd",
    "ParsedToolCall",
    "RenderedChat",
    "ToolCallDone",
    "ToolCallStart",
    "XtmlStreamParser",
    "parse_assistant",
    "render_chat",
]
