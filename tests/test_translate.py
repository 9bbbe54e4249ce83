"""MessagesTranslator: Anthropic Messages requests → llama-server chat-completions bodies."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension

from agentkv import ANY_TOOL
from agentkv.exceptions import InvalidRequestError
from agentkv.translate import BILLING_HEADER_PREFIX, EngineRequest, MessagesTranslator

FIXTURES = Path(__file__).parent / "fixtures"
translator = MessagesTranslator()


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.fixture
def claude_code() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "claude_code_request.json").read_text())
    return data


def base(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "local",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(extra)
    return body


def summary(engine: EngineRequest) -> dict[str, Any]:
    return {
        "body": engine.body,
        "model": engine.model,
        "stream": engine.stream,
        "forced_tool": "ANY_TOOL" if engine.forced_tool is ANY_TOOL else engine.forced_tool,
        "tool_names": list(engine.tool_names),
        "thinking": engine.thinking,
    }


WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.\nUses a public API.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "Local time in a timezone.",
    "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}},
}


# -- snapshots -------------------------------------------------------------------------------


def test_claude_code_request_snapshot(
    claude_code: dict[str, Any], snapshot_json: SnapshotAssertion
) -> None:
    """A realistic Claude Code request translates to the engine body pinned in the snapshot."""
    assert summary(translator.translate(claude_code)) == snapshot_json


def test_forced_named_tool_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """A named tool_choice becomes a json_schema response_format with the tool's schema."""
    body = base(tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_weather"})
    assert summary(translator.translate(body)) == snapshot_json


def test_forced_any_tool_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """tool_choice any over several tools becomes a oneOf over {name, arguments} objects."""
    body = base(tools=[WEATHER, TIME], tool_choice={"type": "any"})
    assert summary(translator.translate(body)) == snapshot_json


# -- the Claude Code request -----------------------------------------------------------------


def test_claude_code_billing_header_dropped(claude_code: dict[str, Any]) -> None:
    """The billing-header system block is not sent, and its cch value does not change the body."""
    first = translator.translate(claude_code)
    other = copy.deepcopy(claude_code)
    other["system"][0]["text"] = other["system"][0]["text"].replace("cch=9c41e", "cch=0a7f2")
    second = translator.translate(other)
    assert first.body == second.body
    assert BILLING_HEADER_PREFIX not in json.dumps(first.body)
    assert first.body["messages"][0]["role"] == "system"
    assert first.body["messages"][0]["content"].startswith("You are Claude Code")


def test_claude_code_fields(claude_code: dict[str, Any]) -> None:
    """Claude Code's values pass through: max_tokens unclamped, stream, thinking, all tools."""
    engine = translator.translate(claude_code)
    assert engine.body["max_tokens"] == 32000
    assert engine.body["stream"] is True and engine.stream is True
    assert engine.thinking is True
    assert len(engine.body["tools"]) == len(claude_code["tools"]) >= 12
    assert engine.forced_tool is None
    for key in ("metadata", "context_management", "output_config", "thinking", "model"):
        assert key not in engine.body


def test_claude_code_mid_conversation_system(claude_code: dict[str, Any]) -> None:
    """A role-system message mid-conversation becomes a user turn inside <system-reminder>."""
    messages = translator.translate(claude_code).body["messages"]
    assert [m["role"] for m in messages].count("system") == 1
    notes = [m for m in messages[1:] if "TodoWrite tool hasn't" in str(m["content"])]
    assert len(notes) == 1
    assert notes[0]["role"] == "user"
    assert notes[0]["content"].startswith("<system-reminder>\n")
    assert notes[0]["content"].endswith("\n</system-reminder>")


# -- system ----------------------------------------------------------------------------------


def test_system_string() -> None:
    """A string system prompt becomes the leading system message."""
    messages = translator.translate(base(system="Be brief.")).body["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}


def test_system_blocks_joined_and_empty_skipped() -> None:
    """System text blocks are joined; empty ones and cache_control leave no trace."""
    system = [
        {"type": "text", "text": "One.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},
        {"type": "text", "text": "Two."},
    ]
    messages = translator.translate(base(system=system)).body["messages"]
    assert messages[0] == {"role": "system", "content": "One.\n\nTwo."}


def test_system_only_billing_header_gives_no_system_message() -> None:
    """A system list holding only the billing header sends no system message at all."""
    system = [{"type": "text", "text": f"{BILLING_HEADER_PREFIX} cc_version=1; cch=abc;"}]
    messages = translator.translate(base(system=system)).body["messages"]
    assert messages == [{"role": "user", "content": "hi"}]


def test_system_note_already_wrapped_not_wrapped_twice() -> None:
    """A mid-conversation note already in <system-reminder> tags is not wrapped again."""
    note = "<system-reminder>\nx\n</system-reminder>"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": note}]},
    ]
    out = MessagesTranslator(session_layout=False).translate(base(messages=messages)).body
    assert out["messages"][-1] == {"role": "user", "content": note}
    # In session layout the note goes before the user's words, in the same turn.
    out = translator.translate(base(messages=messages)).body
    assert out["messages"][-1] == {"role": "user", "content": note + "\n\na"}


# -- blocks ----------------------------------------------------------------------------------


def test_assistant_tool_use_thinking_and_text() -> None:
    """tool_use → tool_calls (JSON string arguments, id kept); thinking → reasoning_content."""
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": ""},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_01abc",
                    "name": "get_weather",
                    "input": {"city": "Zürich"},
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
    ]
    out = translator.translate(base(messages=messages, tools=[WEATHER])).body["messages"]
    assistant = out[1]
    assert assistant["content"] == "Checking."
    assert assistant["reasoning_content"] == "Need the tool."
    (call,) = assistant["tool_calls"]
    assert call["id"] == "toolu_01abc"
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}
    assert "opaque" not in json.dumps(out)


@pytest.mark.parametrize(
    ("content", "is_error", "expected"),
    [
        ("42 degrees", None, "42 degrees"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], False, "a\n\nb"),
        ("no such city", True, "Error: no such city"),
        (None, True, "Error"),
        (None, None, ""),
    ],
)
def test_tool_result(content: Any, is_error: bool | None, expected: str) -> None:
    """tool_result → a tool message with tool_call_id; errors stay visible to the model."""
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": "toolu_1"}
    if content is not None:
        block["content"] = content
    if is_error is not None:
        block["is_error"] = is_error
    out = translator.translate(base(messages=[{"role": "user", "content": [block]}]))
    assert out.body["messages"] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": expected}
    ]


def test_tool_results_then_user_text() -> None:
    """Tool results come first as tool messages, the turn's text follows as a user message."""
    content = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "one"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "two"},
        {"type": "text", "text": "continue"},
    ]
    out = translator.translate(base(messages=[{"role": "user", "content": content}]))
    assert out.body["messages"] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "one"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "two"},
        {"role": "user", "content": "continue"},
    ]


def test_images() -> None:
    """Images become image_url parts: base64 as a data URL, url as is; tool images follow."""
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [
                {"type": "text", "text": "screenshot"},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
            ],
        },
    ]
    out = translator.translate(base(messages=[{"role": "user", "content": content}]))
    assert out.body["messages"] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "screenshot"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
            ],
        },
    ]


def test_empty_text_blocks_never_sent() -> None:
    """Empty text blocks are accepted but no empty text part or block reaches the engine."""
    content = [{"type": "text", "text": ""}, {"type": "text", "text": "x"}]
    body = translator.translate(base(messages=[{"role": "user", "content": content}])).body
    assert body["messages"] == [{"role": "user", "content": "x"}]


# -- tools -----------------------------------------------------------------------------------


def test_tools_auto() -> None:
    """Tools become OpenAI function tools with parameters = input_schema."""
    body = base(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    engine = translator.translate(body)
    assert engine.body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert engine.body["tool_choice"] == "auto"
    assert engine.body["parallel_tool_calls"] is False
    assert engine.forced_tool is None
    assert engine.tool_names == ("get_weather",)


def test_tool_choice_none_omits_tools() -> None:
    """tool_choice none sends no tools at all."""
    engine = translator.translate(base(tools=[WEATHER], tool_choice={"type": "none"}))
    assert "tools" not in engine.body and "tool_choice" not in engine.body
    assert engine.tool_names == ("get_weather",)


def test_tool_choice_named_forces_schema() -> None:
    """A named tool forces its input_schema through json_schema and names forced_tool."""
    body = base(tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    engine = translator.translate(body)
    assert engine.forced_tool == "get_time"
    assert engine.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"schema": TIME["input_schema"]},
    }
    assert "tools" not in engine.body
    assert "get_time" in engine.body["messages"][-1]["content"]


def test_tool_choice_any_with_one_tool_is_named() -> None:
    """tool_choice any with a single tool forces that tool by name."""
    engine = translator.translate(base(tools=[WEATHER], tool_choice={"type": "any"}))
    assert engine.forced_tool == "get_weather"
    assert engine.body["response_format"]["json_schema"]["schema"] == WEATHER["input_schema"]


def test_tool_choice_any_with_several_tools() -> None:
    """tool_choice any with several tools constrains to {name: const, arguments: schema}."""
    engine = translator.translate(base(tools=[WEATHER, TIME], tool_choice={"type": "any"}))
    assert engine.forced_tool is ANY_TOOL
    options = engine.body["response_format"]["json_schema"]["schema"]["oneOf"]
    assert [o["properties"]["name"] for o in options] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    assert options[1]["properties"]["arguments"] == TIME["input_schema"]


def test_forced_note_after_assistant_is_new_user_turn() -> None:
    """When the conversation ends with an assistant turn, the forcing note is a new user turn."""
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = base(messages=messages, tools=[WEATHER], tool_choice={"type": "any"})
    out = translator.translate(body).body["messages"]
    assert out[:2] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert out[2]["role"] == "user" and "get_weather" in out[2]["content"]


def test_sampling_and_stop() -> None:
    """Sampling fields and stop_sequences pass through; metadata is accepted but not sent."""
    body = base(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        stop_sequences=["END"],
        metadata={"user_id": "u"},
        stream=False,
    )
    engine = translator.translate(body).body
    assert (engine["temperature"], engine["top_p"], engine["top_k"]) == (0.2, 0.9, 40)
    assert engine["stop"] == ["END"]
    assert engine["stream"] is False and "stream_options" not in engine
    assert "metadata" not in engine


@pytest.mark.parametrize(
    "thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}]
)
def test_thinking_flag(thinking: dict[str, Any]) -> None:
    """thinking enabled or adaptive sets EngineRequest.thinking; disabled or absent does not."""
    assert translator.translate(base(thinking=thinking)).thinking is True
    assert translator.translate(base(thinking={"type": "disabled"})).thinking is False
    assert translator.translate(base()).thinking is False


def test_unknown_fields_tolerated() -> None:
    """Unknown top-level and block fields are ignored, not rejected."""
    body = base(
        context_management={"edits": [{"type": "clear_thinking_20251015"}]},
        output_config={"effort": "high"},
        brand_new_field={"x": 1},
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "citations": []}]}],
    )
    assert translator.translate(body).body["messages"] == [{"role": "user", "content": "hi"}]


# -- errors ----------------------------------------------------------------------------------


def _without(key: str) -> dict[str, Any]:
    body = base()
    del body[key]
    return body


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (_without("messages"), "messages"),
        (_without("max_tokens"), "max_tokens"),
        (base(max_tokens=0), "max_tokens"),
        (base(max_tokens="64"), "max_tokens"),
        (base(max_tokens=True), "max_tokens"),
        (base(messages="hi"), "messages"),
        (base(messages=[]), "messages"),
        (base(messages=["hi"]), "messages[0]"),
        (base(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (base(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        (
            base(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": [{}]}]),
            "messages[1].content[0].type",
        ),
        (
            base(
                messages=[
                    {"role": "user", "content": [{"type": "text", "text": "a"}] * 2},
                    {"role": "assistant", "content": [{"type": "video"}]},
                ]
            ),
            "messages[1].content[0].type",
        ),
        (
            base(
                messages=[
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "x"}],
                    }
                ]
            ),
            "messages[0].content[0].input",
        ),
        (base(system=[{"type": "image"}]), "system[0].type"),
        (base(temperature="hot"), "temperature"),
        (base(stop_sequences="END"), "stop_sequences"),
        (base(tools=[{"name": 1}]), "tools[0].name"),
        (base(tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (base(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
        (base(tool_choice={"type": "tool", "name": "get_weather"}), "tool_choice.name"),
        (base(tool_choice={"type": "any"}), "tool_choice.type"),
        (base(metadata={"user_id": 5}), "metadata.user_id"),
    ],
)
def test_invalid_request_names_path(body: dict[str, Any], path: str) -> None:
    """A wrong known field is a 400 invalid_request_error naming the field path."""
    with pytest.raises(InvalidRequestError) as info:
        translator.translate(body)
    assert info.value.path == path
    assert info.value.status == 400
    assert info.value.to_anthropic()["error"]["message"].startswith(f"{path}: ")


def test_non_object_body() -> None:
    """A body that is not a JSON object is a 400."""
    with pytest.raises(InvalidRequestError):
        translator.translate([])  # type: ignore[arg-type]


# -- laws ------------------------------------------------------------------------------------

_text = st.text(alphabet="ab \n", max_size=6)
_user_block = st.one_of(
    _text.map(lambda t: {"type": "text", "text": t}),
    st.builds(
        lambda t, e: {"type": "tool_result", "tool_use_id": "toolu_x", "content": t, "is_error": e},
        _text,
        st.booleans(),
    ),
)
_assistant_block = st.one_of(
    _text.map(lambda t: {"type": "text", "text": t}),
    _text.map(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}),
    st.builds(
        lambda t: {"type": "tool_use", "id": "toolu_y", "name": "get_weather", "input": {"c": t}},
        _text,
    ),
)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, st.one_of(_text, st.lists(_user_block))),
    st.builds(lambda c: {"role": "assistant", "content": c}, st.lists(_assistant_block)),
    st.builds(lambda c: {"role": "system", "content": c}, _text),
)


def _is_human(message: dict[str, Any]) -> bool:
    content = message["content"]
    return message["role"] == "user" and not (
        isinstance(content, list) and any(b["type"] == "tool_result" for b in content)
    )


@given(
    st.lists(_message, min_size=1, max_size=6),
    st.integers(min_value=0, max_value=6),
    st.booleans(),
)
def test_growing_conversation_only_appends(
    messages: list[dict[str, Any]], cut: int, layout: bool
) -> None:
    """The engine messages for a conversation's first k turns prefix those for the whole.

    A turn is a human message with the system notes sent right after it (they arrive together):
    in session layout the notes go before the words, so a cut never separates them.
    """
    cut = max(1, min(cut, len(messages)))
    if layout and (_is_human(messages[cut - 1]) or messages[cut - 1]["role"] == "system"):
        # A cut inside a turn's notes (or right after its words) is no state a client sends.
        while cut < len(messages) and messages[cut]["role"] == "system":
            cut += 1
    translate = MessagesTranslator(session_layout=layout).translate
    whole = translate(base(messages=messages, system="S")).body["messages"]
    head = translate(base(messages=messages[:cut], system="S")).body["messages"]
    assert whole[: len(head)] == head
    for message in whole:
        if isinstance(message["content"], list):
            assert all(part.get("text", "image") for part in message["content"])
