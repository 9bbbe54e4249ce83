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
from agentkv.fingerprint import canonical_json
from agentkv.layout import MEMORY_REFERENCE, PROJECT_HEADER, SESSION_HEADER
from agentkv.translate import (
    BILLING_HEADER_PREFIX,
    EngineRequest,
    MessagesTranslator,
    first_difference,
)

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


def test_the_retry_note_over_no_callable_tool_keeps_its_blank_listing() -> None:
    """The one-call retry's note lists the tools with a schema; with none it is the head and an
    empty listing, byte for byte as before."""
    body = base(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    request = translator.translate(body)
    assert "tools" not in request.body
    retry = translator.force_any_tool(request, request.body)
    assert retry["tool_choice"] == "none"
    assert retry["messages"][-1]["content"].endswith(
        '"arguments": <its input>}.\n\n</system-reminder>'
    )


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


# -- the project layout: Claude Code in several projects -------------------------------------

CAPTURED = FIXTURES / "claude_code"


def captured(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((CAPTURED / name).read_text())["body"]
    return body


def prompt_text(body: dict[str, Any]) -> str:
    """An engine body in the order it reaches the prompt: system, tools, then the turns."""
    messages = body["messages"]
    parts = [canonical_json(messages[0]), canonical_json(body.get("tools", []))]
    parts.extend(canonical_json(message) for message in messages[1:])
    return "\n".join(parts)


def shared_chars(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_two_projects_share_all_but_the_projects_own_lines() -> None:
    """Two fresh agents in two directories differ only from the project's facts block on."""
    a = translator.translate(captured("a_one_word.json"))
    d = translator.translate(captured("d_other_project.json"))
    assert a.body["messages"][0] == d.body["messages"][0]  # the system prompt
    assert a.body["tools"] == d.body["tools"]
    first_a, first_d = a.body["messages"][1]["content"], d.body["messages"][1]["content"]
    assert first_a.split(PROJECT_HEADER)[0] == first_d.split(PROJECT_HEADER)[0]
    assert first_difference(a.sections, d.sections) == "message 0 (project facts)"
    text_a, text_d = prompt_text(a.body), prompt_text(d.body)
    shared = shared_chars(text_a, text_d)
    assert shared / len(text_d) > 0.99
    # Without the layout they part inside the system prompt, 4 KB in.
    plain = MessagesTranslator(session_layout=False)
    text_a = prompt_text(plain.translate(captured("a_one_word.json")).body)
    text_d = prompt_text(plain.translate(captured("d_other_project.json")).body)
    assert shared_chars(text_a, text_d) < 5000


def test_project_layout_keeps_every_fact() -> None:
    """What moves keeps its words: the memory directory, each fact line and the date."""
    body = captured("a_one_word.json")
    system = body["system"][2]["text"]
    note = body["messages"][1]["content"][0]["text"]
    memory_dir = "/home/demo/.claude/projects/-tmp-agentkv-demo/memory/"
    assert f"`{memory_dir}`" in system
    out = translator.translate(body).body["messages"]
    head, first = out[0]["content"], out[1]["content"]
    assert memory_dir not in head and MEMORY_REFERENCE in head
    assert head == "\n\n".join(
        b["text"].replace(f"`{memory_dir}`", MEMORY_REFERENCE) for b in body["system"][1:]
    )
    assert f" - Memory directory: `{memory_dir}`" in first
    for line in note.split("\n"):
        assert line in first  # every line of the note, facts included, is still there
    for block in body["messages"][0]["content"]:
        for line in block["text"].split("\n"):
            assert line in first  # the reminders' lines too (the git status one is reordered)
    assert first.endswith("\n\nReply with the single word: alpha")
    assert len(out) == 2


def test_project_layout_order_in_the_first_turn() -> None:
    """Notes, then shared reminders, session facts, git status (its values last), project
    facts, the words."""
    first = translator.translate(captured("a_one_word.json")).body["messages"][1]["content"]
    marks = [
        "# Environment\nYou have been invoked",
        "Attribution for git commits",
        SESSION_HEADER + "\n - Platform: linux\n - Shell: bash\n - OS Version:",
        "the following context:\nClaude Code attached this context automatically;",
        "# gitStatus",
        "Recent commits:\n21d7d7d init\n</system-reminder>",
        PROJECT_HEADER + "\n - Memory directory:",
        "Reply with the single word: alpha",
    ]
    positions = [first.index(mark) for mark in marks]
    assert positions == sorted(positions)
    session = "OS Version: Linux 6.18.44-fc-v769\n - Is a git repository: true\n"
    assert session + "Today's date is 2026-11-30.\n</system-reminder>" in first
    assert first.count("Primary working directory: /tmp/agentkv-demo") == 1


def test_project_layout_off_sends_the_prompt_as_written() -> None:
    """--no-session-layout: the memory directory stays in the system prompt, the note after the
    user's words, untouched."""
    body = captured("a_one_word.json")
    out = MessagesTranslator(session_layout=False).translate(body).body["messages"]
    assert out[0]["content"] == "\n\n".join(b["text"] for b in body["system"][1:])
    assert out[-1]["content"].startswith("<system-reminder>\n# Environment\n")
    assert PROJECT_HEADER not in json.dumps(out)


def test_stem_of_a_first_request_ends_before_the_words() -> None:
    """The shareable head of a first request is all of it but the user's words."""
    engine = translator.translate(captured("a_one_word.json"))
    assert engine.stem_body is not None
    stem, whole = engine.stem_body["messages"], engine.body["messages"]
    assert stem[:-1] == whole[:-1]
    assert whole[-1]["content"] == stem[-1]["content"] + "\n\nReply with the single word: alpha"
    assert stem[-1]["content"].rstrip().endswith("</system-reminder>")


def _cc_request(system: str, note: str | None = None, first: Any = "go") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    if note is not None:
        messages.append({"role": "system", "content": note})
    return base(system=[{"type": "text", "text": system}], messages=messages)


MEMORY = "You have a persistent file-based memory at `/home/u/.claude/projects/-p/memory/`."
NOTE = (
    "# Environment\nYou have been invoked in the following environment: \n"
    " - Primary working directory: /p\n - Platform: linux\n - Be careful.\n\n"
    "Today's date is 2026-01-02."
)


@pytest.mark.parametrize(
    ("request_body", "why"),
    [
        (
            _cc_request(MEMORY + " Or `/home/u/.claude/projects/-q/memory/`."),
            "two memory directories",
        ),
        (
            _cc_request(
                MEMORY,
                first=[{"type": "tool_result", "tool_use_id": "toolu_x", "content": "ok"}],
            ),
            "no human turn to take the path",
        ),
        (_cc_request("No memory here."), "no memory directory"),
    ],
)
def test_system_prompt_not_recognised_is_sent_as_written(
    request_body: dict[str, Any], why: str
) -> None:
    """A system prompt the rewrite does not recognise reaches the engine unchanged."""
    out = translator.translate(request_body).body["messages"]
    assert out[0]["content"] == request_body["system"][0]["text"], why
    assert PROJECT_HEADER not in json.dumps(out), why


@pytest.mark.parametrize(
    "note",
    [
        NOTE.replace("You have been invoked in the following environment: \n", ""),
        NOTE.replace("# Environment\n", "# Context\n"),
        "Some other note.\n - Platform: linux",
    ],
)
def test_note_not_recognised_is_sent_as_written(note: str) -> None:
    """A system note without the environment note's heading and lead line keeps its lines."""
    out = translator.translate(_cc_request("S", note)).body["messages"]
    assert out[1]["content"] == f"<system-reminder>\n{note}\n</system-reminder>\n\ngo"


def test_recognised_note_and_memory_directory_move() -> None:
    """The small recognised shapes: facts out of the note, the path out of the system text."""
    out = translator.translate(_cc_request(MEMORY, NOTE)).body["messages"]
    assert out[0]["content"] == f"You have a persistent file-based memory at {MEMORY_REFERENCE}."
    assert out[1]["content"] == (
        "<system-reminder>\n# Environment\nYou have been invoked in the following environment: \n"
        " - Be careful.\n</system-reminder>\n\n"
        f"<system-reminder>\n{SESSION_HEADER}\n - Platform: linux\nToday's date is 2026-01-02.\n"
        "</system-reminder>\n\n"
        f"<system-reminder>\n{PROJECT_HEADER}\n - Memory directory: "
        "`/home/u/.claude/projects/-p/memory/`\n - Primary working directory: /p\n"
        "</system-reminder>\n\ngo"
    )


_cc_system = st.sampled_from(["S", MEMORY])
_cc_note = st.sampled_from([NOTE, "plain note", NOTE.replace("/p", "/q")])
_reminder = st.sampled_from(
    [
        "<system-reminder>\nAttribution\n</system-reminder>",
        "<system-reminder>\nAs you answer the user's questions, you can use the following "
        "context:\n# gitStatus\nmain\n</system-reminder>",
    ]
)
_cc_user = st.lists(
    st.one_of(_user_block, _reminder.map(lambda t: {"type": "text", "text": t})), max_size=4
)
_cc_message = st.one_of(
    _message,
    st.builds(lambda c: {"role": "user", "content": c}, _cc_user),
    st.builds(lambda c: {"role": "system", "content": c}, _cc_note),
)


@given(
    st.lists(_cc_message, min_size=1, max_size=6),
    st.integers(min_value=0, max_value=6),
    st.booleans(),
    _cc_system,
)
def test_growing_claude_code_conversation_only_appends(
    messages: list[dict[str, Any]], cut: int, layout: bool, system: str
) -> None:
    """With Claude Code's shapes (memory directory, environment notes, reminders) too, the
    engine messages for a conversation's first k turns prefix those for the whole."""
    cut = max(1, min(cut, len(messages)))
    if layout and (_is_human(messages[cut - 1]) or messages[cut - 1]["role"] == "system"):
        while cut < len(messages) and messages[cut]["role"] == "system":
            cut += 1
    translate = MessagesTranslator(session_layout=layout).translate
    whole = translate(base(messages=messages, system=system)).body["messages"]
    head = translate(base(messages=messages[:cut], system=system)).body["messages"]
    assert whole[: len(head)] == head
    text = json.dumps(whole)
    # Nothing is lost: the path is in the prompt exactly when the client sent it.
    assert ("/home/u/.claude/projects/-p/memory/" in text) == (system == MEMORY)


GIT_STATUS = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
    "# gitStatus\nThe status.\n\nCurrent branch: main\n\n"
    "Claude Code attached this context automatically; it isn't part of the user's message.\n"
    "</system-reminder>\n"
)


def test_git_status_reminder_values_last() -> None:
    """The user-context reminder keeps its lines; its closing paragraph moves up, before the
    project's values; a reminder of another shape is sent as written."""
    out = translator.translate(_cc_request("S", first=[{"type": "text", "text": GIT_STATUS}]))
    assert out.body["messages"][1]["content"] == (
        "<system-reminder>\nAs you answer the user's questions, you can use the following "
        "context:\nClaude Code attached this context automatically; it isn't part of the "
        "user's message.\n# gitStatus\nThe status.\n\nCurrent branch: main\n</system-reminder>\n"
    )
    other = GIT_STATUS.replace("Claude Code attached", "Someone attached")
    out = translator.translate(_cc_request("S", first=[{"type": "text", "text": other}]))
    assert out.body["messages"][1]["content"] == other
