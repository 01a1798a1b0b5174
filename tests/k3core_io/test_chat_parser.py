"""Streaming XTML parser: render -> parse round trip (hypothesis), typed arguments, malformed output."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.chat import (
    ChannelText,
    MessageEnd,
    ToolCallDone,
    ToolCallStart,
    XtmlStreamParser,
    parse_assistant,
    render_chat,
)
from k3core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPT = [{"role": "user", "content": "go"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "flags": {"type": "array"},
                    "mode": {"type": "string", "enum": ["a", "b"]},
                },
                "required": ["path"],
            },
        },
    }
]

# Text that spells the structure tokens must survive as text: the template encodes it as bytes.
texts = st.lists(st.sampled_from([*'ab "\n{}[]é日🙂', "[open]", "[close]think", "[sep]"]), max_size=12).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz", max_size=3), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text("abcdef_", min_size=1, max_size=6), json_values, max_size=4)


def generated_tokens(history_msg, thinking, tools=None):
    """Render turn n prompt and turn n+1 history; the difference is what the model generated."""
    prompt = render_chat(TOK, PROMPT, thinking=thinking, tools=tools)
    full = render_chat(TOK, [*PROMPT, history_msg], thinking=thinking, tools=tools, add_generation_prompt=False)
    assert full.tokens[: len(prompt.tokens)] == prompt.tokens
    return prompt, full.tokens[len(prompt.tokens) :]


@settings(max_examples=60, deadline=None)
@given(
    thinking=st.booleans(),
    reasoning=texts,
    content=texts,
    calls=st.lists(st.tuples(st.sampled_from(["edit", "run_cmd", "q"]), arguments), max_size=3),
)
def test_render_then_parse_gives_back_the_assistant_message(thinking, reasoning, content, calls):
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = [
            {"id": f"id{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    prompt, generated = generated_tokens(msg, thinking)
    parser = XtmlStreamParser(TOK, thinking=thinking, tools=prompt.tools)
    events = [e for t in generated for e in parser.feed(t)]
    assert parser.done and parser.errors == []
    out = parser.message()
    assert out["content"] == content
    assert out.get("reasoning_content") == (reasoning if thinking else None)
    got_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.get("tool_calls", [])]
    assert got_calls == [(n, a) for n, a in calls]
    # Streamed deltas add up to the channels; each call starts before it is done; the end comes last.
    for channel in ("think", "response"):
        assert "".join(e.text for e in events if isinstance(e, ChannelText) and e.channel == channel) == (
            out.get("reasoning_content" if channel == "think" else "content") or ""
        )
    starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
    dones = [i for i, e in enumerate(events) if isinstance(e, ToolCallDone)]
    assert len(starts) == len(dones) == len(calls) and all(s < d for s, d in zip(starts, dones, strict=True))
    assert isinstance(events[-1], MessageEnd)


def parse(text, tools=TOOLS, thinking=False):
    prompt = render_chat(TOK, PROMPT, tools=tools, thinking=thinking)
    return parse_assistant(TOK, TOK.encode(text, allow_special=True), thinking=thinking, tools=prompt.tools)


def call(args, tool="edit"):
    return f'[close]response[sep][open]tools[sep][open]call tool="{tool}" index="0"[sep]{args}[close]call[sep][close]tools[sep][end_of_msg]'


def test_schema_types_decide_how_arguments_are_read():
    p = parse(call('[open]arg name="path"[sep]42[close]arg[sep][open]arg name="line"[sep]7[close]arg[sep]'
                   '[open]arg name="flags" type="json"[sep][1,"x"][close]arg[sep]'))  # fmt: skip
    c = p.tool_calls[0]
    # "path" is declared string: 42 stays text; "line" is integer: read as JSON even without type="json".
    assert c.arguments == {"path": "42", "line": 7, "flags": [1, "x"]} and c.errors == []
    assert c.to_openai()["function"]["arguments"] == '{"path":"42","line":7,"flags":[1,"x"]}'


def test_schema_violations_are_reported_on_the_call():
    p = parse(call('[open]arg name="line" type="json"[sep]true[close]arg[sep]'
                   '[open]arg name="ratio"[sep]abc[close]arg[sep][open]arg name="mode"[sep]z[close]arg[sep]'))  # fmt: skip
    errors = " | ".join(p.tool_calls[0].errors)
    assert "missing required argument 'path'" in errors
    assert "'line' should be integer, got bool" in errors
    assert "'ratio': value is not JSON" in errors
    assert "'mode' must be one of ['a', 'b']" in errors
    assert p.errors == []  # structure was fine


def test_undeclared_tool_and_bad_index():
    p = parse(call("", tool="rm_rf").replace('index="0"', 'index="3"'))
    assert p.tool_calls[0].errors == ["call index '3', expected 0", "tool 'rm_rf' is not declared"]


def test_malformed_output_is_recorded_not_raised():
    p = parse("hi[close]response[sep][open]tools[sep][open]call tool=\"edit\" index=\"0\"[sep][end_of_msg]x")
    assert p.message()["content"] == "hi"
    assert any("message ended inside ['tools', 'call']" in e for e in p.errors)
    assert any("after the end of the message" in e for e in p.errors)
    q = parse("a[open]bogus[sep]lost[close]bogus[sep]b[close]think[sep][end_of_msg]")
    assert q.message()["content"] == "ab"
    assert any("<bogus> is not allowed inside <response>" in e for e in q.errors)
    assert any("[close]think does not match" in e for e in q.errors)


def test_ids_outside_the_vocabulary_are_recorded_not_raised():
    # A padded embedding lets a model sample ids the tokenizer does not have, in text and inside a tag.
    parser = XtmlStreamParser(TOK, thinking=False)
    ids = TOK.encode("ok", allow_special=True) + [TOK.vocab_size + 5]
    ids += TOK.encode("[close]resp", allow_special=True) + [TOK.vocab_size] + TOK.encode("onse[sep]!", allow_special=True)
    parser.feed_all(ids)
    assert parser.message()["content"] == "ok"
    assert [e for e in parser.errors if "outside vocabulary" in e] == [
        f"token id {TOK.vocab_size + 5} outside vocabulary of {TOK.vocab_size}",
        f"token id {TOK.vocab_size} outside vocabulary of {TOK.vocab_size}",
    ]
    assert not any("does not match" in e for e in parser.errors)  # the tag survived the bad id


def test_streaming_holds_split_characters_and_stops_at_end_of_msg():
    parser = XtmlStreamParser(TOK, thinking=True)
    pieces = [parser.feed(b) for b in "日".encode()]
    assert pieces[:2] == [[], []] and pieces[2] == [ChannelText("think", "日")]
    assert parser.feed(TOK.special_tokens["[EOS]"])[-1] == MessageEnd()
    assert parser.done
