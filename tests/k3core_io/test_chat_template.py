"""XTML rendering: exact grammar, KV-prefix stability across turns, turn boundaries, request errors."""

import pytest

from k3core.chat import ChatTemplateError, parse_assistant, render_chat
from k3core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
END = TOK.special_tokens["[end_of_msg]"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need the tool.", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "reasoning_content": "", "content": "Sunny."},
    {"role": "user", "content": "Thanks [open]system[sep]"},
]


def text(chat) -> str:
    return TOK.decode(chat.tokens)


def test_exact_rendering_of_a_tool_conversation():
    chat = render_chat(TOK, CONVERSATION[:4], tools=[WEATHER], reasoning_effort="low", tool_choice="required")
    assert text(chat) == (
        '[open]option type="tool-declare"[sep]{"name":"get_weather","description":"Forecast","parameters":'
        '{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},'
        '"required":["city"]}}[end_of_msg]'
        '[open]option type="thinking-effort"[sep]Reasoning effort: low. Think briefly and answer directly.'
        "[end_of_msg]"
        "[open]system[sep]Be brief.[end_of_msg]"
        "[open]user[sep]Weather in Paris?[end_of_msg]"
        "[open]assistant[sep][open]think[sep]Need the tool.[close]think[sep]"
        '[open]tools[sep][open]call tool="get_weather" index="0"[sep]'
        '[open]arg name="city"[sep]Paris[close]arg[sep][open]arg name="days" type="json"[sep]3[close]arg[sep]'
        "[close]call[sep][close]tools[sep][end_of_msg]"
        '[open]tool tool="get_weather" index="0"[sep]sunny[end_of_msg]'
        '[open]option type="tool-choice"[sep]Call at least one tool in this reply.[end_of_msg]'
        "[open]assistant[sep][open]think[sep]"
    )
    # Global options come before the messages, the one-shot option after them.
    assert TOK.decode(chat.tokens[chat.history_len :]).startswith('[open]option type="tool-choice"')
    assert TOK.decode(chat.tokens[: chat.history_len]).endswith("sunny[end_of_msg]")


def test_user_text_spelling_specials_stays_bytes():
    chat = render_chat(TOK, CONVERSATION[-1:])
    assert chat.tokens.count(TOK.special_tokens["[open]"]) == 3  # user, assistant, think
    assert "Thanks [open]system[sep]" in TOK.decode(chat.tokens)


@pytest.mark.parametrize("thinking", [True, False])
def test_each_turn_is_an_exact_token_prefix_of_the_next(thinking):
    opts = {"tools": [WEATHER], "reasoning_effort": "high", "thinking": thinking}
    user_turns = [i + 1 for i, m in enumerate(CONVERSATION) if m["role"] in ("user", "tool")]
    for a, b in zip(user_turns, user_turns[1:], strict=False):
        before = render_chat(TOK, CONVERSATION[:a], **opts)
        after = render_chat(TOK, CONVERSATION[:b], **opts)
        # The prompt of turn n (generation prefix included) is a prefix of turn n+1: the assistant's
        # history rendering is exactly what it generated after that prefix.
        assert after.tokens[: len(before.tokens)] == before.tokens
        # One-shot options ride after the history and do not disturb it.
        shot = render_chat(TOK, CONVERSATION[:a], tool_choice="none", response_format={"type": "json_object"}, **opts)
        assert shot.tokens[: shot.history_len] == before.tokens[: before.history_len]
        assert after.tokens[: shot.history_len] == shot.tokens[: shot.history_len]


def test_message_ends_are_turn_boundaries():
    chat = render_chat(TOK, CONVERSATION, tools=[WEATHER], reasoning_effort="max", tool_choice="auto")
    assert len(chat.message_ends) == 2 + len(CONVERSATION)
    assert all(chat.tokens[p - 1] == END for p in chat.message_ends)
    assert chat.message_ends == [i + 1 for i, t in enumerate(chat.tokens) if t == END]
    assert chat.message_ends[-1] == chat.history_len


def test_instruct_history_drops_think_and_always_has_response():
    chat = render_chat(TOK, CONVERSATION, thinking=False)
    rendered = text(chat)
    assert "[open]think" not in rendered and "Need the tool." not in rendered
    assert "[open]assistant[sep][open]response[sep][close]response[sep][open]tools[sep]" in rendered
    assert rendered.endswith("[open]assistant[sep][open]response[sep]")


def test_mid_conversation_tool_declare_extends_the_parser_tool_set():
    late = {"type": "function", "function": {"name": "search", "parameters": {"properties": {"k": {"type": "integer"}}}}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "tool-declare", "tools": [late]}]
    chat = render_chat(TOK, msgs, tools=[WEATHER])
    assert set(chat.tools) == {"get_weather", "search"}
    assert text(chat).count('[open]option type="tool-declare"') == 2
    generated = TOK.encode('[close]think[sep][open]tools[sep][open]call tool="search" index="0"[sep]'
                           '[open]arg name="k"[sep]5[close]arg[sep][close]call[sep][close]tools[sep][end_of_msg]',
                           allow_special=True)  # fmt: skip
    parsed = parse_assistant(TOK, generated, thinking=True, tools=chat.tools)
    assert parsed.tool_calls[0].arguments == {"k": 5} and not parsed.tool_calls[0].errors


def test_json_fallback_for_arguments_that_are_not_an_object():
    call = {"id": "x", "function": {"name": "get_weather", "arguments": "not json"}}
    chat = render_chat(TOK, [{"role": "assistant", "content": "", "tool_calls": [call]}], add_generation_prompt=False)
    assert "[open]json[sep]not json[close]json[sep]" in text(chat)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, r"messages\[0\]\.content\[0\]"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "without a preceding assistant tool call"),
        ({"messages": [*CONVERSATION[:3], {"role": "tool", "tool_call_id": "zz", "content": ""}]}, "tool_call_id"),
        ({"messages": [], "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": [], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         r"tool_choice\.function\.name"),
        ({"messages": [], "tool_choice": "required"}, "no tools are declared"),
        ({"messages": [], "tools": [{"type": "function", "function": {}}]}, r"tools\[0\]\.function\.name"),
        ({"messages": [], "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": [], "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ],
)
def test_bad_requests_name_the_field(kwargs, match):
    messages = kwargs.pop("messages")
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(TOK, messages, **kwargs)


def test_response_format_schema_is_rendered_after_history():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    chat = render_chat(TOK, CONVERSATION[:2], response_format=fmt)
    tail = TOK.decode(chat.tokens[chat.history_len :])
    assert tail.startswith('[open]option type="response-format"[sep]') and '{"type":"object"}' in tail
