"""OpenAITranslator: OpenAI Responses and Chat Completions bodies → the runtime's Messages body."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension

from agentkv.exceptions import InvalidRequestError
from agentkv.openai_translate import DEFAULT_MAX_TOKENS, OpenAITranslator, ToolOrigin
from agentkv.translate import MessagesTranslator

FIXTURES = Path(__file__).parent / "fixtures"
translator = OpenAITranslator()
messages_translator = MessagesTranslator()


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.fixture(scope="module")
def codex() -> dict[str, Any]:
    return json.loads((FIXTURES / "codex_first_request.json").read_text())  # type: ignore[no-any-return]


def short(text: str, keep: int = 80) -> str:
    return text if len(text) <= keep else f"{text[:keep]}… ({len(text)} chars)"


def summary(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages body with long texts shortened, for snapshots."""
    out = copy.deepcopy(body)
    if isinstance(out.get("system"), str):
        out["system"] = short(out["system"])
    for tool in out.get("tools", []):
        tool["description"] = short(tool.get("description", ""), 40)
        tool["input_schema"] = sorted(tool["input_schema"].get("properties", {}))
    for message in out["messages"]:
        content = message["content"]
        if isinstance(content, str):
            message["content"] = short(content)
            continue
        for block in content:
            for key in ("text", "thinking"):
                if key in block:
                    block[key] = short(block[key])
    return out


# -- Codex's own request ---------------------------------------------------------------------------


def test_codex_first_request_snapshot(
    codex: dict[str, Any], snapshot_json: SnapshotAssertion
) -> None:
    """Codex's first request becomes the Messages body pinned in the snapshot."""
    request = translator.responses(codex["body"])
    assert request.stream is True
    assert summary(request.body) == snapshot_json


def test_codex_request_is_a_valid_messages_request(codex: dict[str, Any]) -> None:
    """The translated body passes the Messages translator: developer text is the system prompt,
    namespaced tools are flattened, web_search is left out, parallel calls stay allowed."""
    request = translator.responses(codex["body"])
    engine = messages_translator.translate(request.body)
    assert engine.body["messages"][0]["role"] == "system"
    assert engine.body["messages"][0]["content"].startswith("You are a coding agent running in")
    names = [tool["function"]["name"] for tool in engine.body["tools"]]
    assert "exec_command" in names and "multi_agent_v1.spawn_agent" in names
    assert all("web_search" not in name for name in names)
    assert engine.body["parallel_tool_calls"] is True
    assert request.tools["multi_agent_v1.spawn_agent"] == ToolOrigin(
        "spawn_agent", namespace="multi_agent_v1"
    )
    assert engine.body["messages"][-1] == {
        "role": "user",
        "content": "Reply with the single word: alpha",
    }


def test_two_sessions_in_one_project_differ_only_in_their_words(codex: dict[str, Any]) -> None:
    """Two fresh Codex sessions in one project (same files, other prompt) share every engine
    message but the last: the prompt is laid out for the prefix cache."""
    other = copy.deepcopy(codex["body"])
    other["input"][-1]["content"][0]["text"] = "Reply with the single word: beta"
    other["prompt_cache_key"] = "another-session"
    one = messages_translator.translate(translator.responses(codex["body"]).body).body
    two = messages_translator.translate(translator.responses(other).body).body
    assert one["messages"][:-1] == two["messages"][:-1]
    assert one["tools"] == two["tools"]
    assert one["messages"][-1] != two["messages"][-1]


# -- a conversation that grows ---------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}

TURNS: list[list[dict[str, Any]]] = [
    [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    ],
    [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "which city?"}],
        },
    ],
    [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny in Paris."}],
        },
        {"role": "developer", "content": "The user switched to metric units."},
        {"role": "user", "content": "And tomorrow?"},
    ],
]


def conversation(turns: int) -> dict[str, Any]:
    items = [item for turn in TURNS[:turns] for item in turn]
    return {"model": "m", "input": copy.deepcopy(items), "tools": [WEATHER], "stream": True}


def test_conversation_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """Calls, their outputs, reasoning and a later developer note, as Messages."""
    assert translator.responses(conversation(3)).body == snapshot_json


def test_a_growing_conversation_only_appends_to_the_engine_prompt() -> None:
    """Each request's engine messages start with the previous request's, so the cache hits."""
    previous: list[dict[str, Any]] = []
    for turns in range(1, len(TURNS) + 1):
        body = translator.responses(conversation(turns)).body
        messages = messages_translator.translate(body).body["messages"]
        assert messages[: len(previous)] == previous
        previous = messages


def test_chat_conversation_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """A Chat Completions conversation with a tool round trip, as Messages."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_completion_tokens": 100,
        "stop": "END",
        "temperature": 0.2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = translator.chat(body)
    assert request.include_usage
    assert request.body == snapshot_json


def test_forced_function_becomes_a_forced_tool() -> None:
    """tool_choice naming a function forces that tool (constrained decoding in the runtime)."""
    body = conversation(1) | {"tool_choice": {"type": "function", "name": "get_weather"}}
    assert translator.responses(body).body["tool_choice"] == {"type": "tool", "name": "get_weather"}
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    engine = messages_translator.translate(translator.chat(chat).body)
    assert engine.forced_tool == "get_weather"


def test_defaults() -> None:
    """A plain string input, no options: one user message and the default reply length."""
    request = translator.responses({"model": "m", "input": "hi"})
    assert request.body == {
        "model": "m",
        "max_tokens": DEFAULT_MAX_TOKENS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": False,
    }
    assert request.stream is False


def test_images_become_image_blocks() -> None:
    """A data: URL is inline base64, an https URL stays a URL."""
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
                    {"type": "input_image", "image_url": "https://example.com/a.png"},
                ],
            }
        ],
    }
    blocks = translator.responses(body).body["messages"][0]["content"]
    assert blocks == [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ]


def test_custom_tool_is_one_string_parameter() -> None:
    """A custom (free-form) tool is a function with one ``input`` string for the engine."""
    body = {
        "model": "m",
        "input": "patch it",
        "tools": [
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Apply a patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            }
        ],
    }
    request = translator.responses(body)
    tool = request.body["tools"][0]
    assert tool["input_schema"]["required"] == ["input"]
    assert "start: /.+/" in tool["description"]
    assert request.tools["apply_patch"].custom


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"background": True}, "background", "not supported"),
        ({"model": None}, "model", "is required"),
        ({"model": 5}, "model", "expected a string"),
        ({"input": []}, "input", "at least one item"),
        ({"input": 5}, "input", "expected a string or a list"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "keeps no items"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type", "not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "input_file",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            "JSON object",
        ),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type", "not supported"),
        ({"tools": [{"type": {"type": "thinking"}}]}, "tools[0].type", "not supported"),
        ({"tools": [{"type": "x" * 100_000}]}, "tools[0].type", "…"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]", "second time"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "not in"),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.type", "json_schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"temperature": 3}, "temperature", "from 0 to 2"),
        ({"stream": "yes"}, "stream", "boolean"),
    ],
)
def test_responses_refusals_name_the_field(change: dict[str, Any], param: str, words: str) -> None:
    """Unsupported or malformed fields get a 400 that names the OpenAI field."""
    body = {"model": "m", "input": "hi"} | change
    with pytest.raises(InvalidRequestError) as caught:
        translator.responses(body)
    assert caught.value.path == param
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"n": 2}, "n", "n=1"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "tool"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
            "input_audio",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format.type", "json_object"),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "not supported"),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"stop": [1]}, "stop", "list of strings"),
        ({"modalities": ["audio"]}, "modalities", "text"),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "expected a string",
        ),
    ],
)
def test_chat_refusals_name_the_field(change: dict[str, Any], param: str, words: str) -> None:
    """Chat Completions: the same, for its own fields."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | change
    with pytest.raises(InvalidRequestError) as caught:
        translator.chat(body)
    assert caught.value.path == param
    assert words in caught.value.message


def test_relocate_names_the_client_field() -> None:
    """A Messages path found later (by the runtime's checks) reads as the client's own field."""
    request = translator.responses(conversation(3))
    assert request.relocate("messages[0].content[0].text") == "input[1].content[0].text"
    # The second parallel call is a block of the assistant message that the reasoning opened.
    assert request.relocate("messages[1].content[2].input") == "input[4].input"
    assert request.relocate("tools[0].input_schema") == "tools[0].input_schema"
    assert request.relocate("max_tokens") == "max_output_tokens"
    assert request.relocate(None) is None
    assert request.relocate("elsewhere") == "elsewhere"


# -- the structured shapes' errors, word for word -------------------------------------------------

RESPONSES_FIELD_ERRORS: list[tuple[dict[str, Any], str, str]] = [
    ({"input": None}, "input", "is required"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        "input[0].arguments",
        "is not valid JSON",
    ),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "expected a string, got null",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
        "input[0].name",
        "expected a non-empty string",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
        "expected a string, got null",
    ),
    (
        {
            "input": [
                {"role": "system", "content": [{"type": "input_image", "image_url": "https://x"}]}
            ]
        },
        "input[0].content[0].type",
        "'input_image' is not supported here (accepted: input_text)",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        "input[0].content[0].file_id",
        "file_id is not supported: agentkv stores no files; send image_url",
    ),
    (
        {
            "input": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}
            ]
        },
        "input[0].content[0].image_url.url",
        "a data: URL must be data:<type>;base64,<data>",
    ),
    (
        {"input": [{"content": "x"}]},
        "input[0].type",
        "None is not supported (message, function_call, function_call_output, custom_tool_call, "
        "custom_tool_call_output and reasoning items are)",
    ),
    (
        {"input": [{"role": "user", "content": 5}]},
        "input[0].content",
        "expected a string or a list of parts, got integer",
    ),
    (
        {"input": [{"type": "custom_tool_call_output", "output": "x"}]},
        "input[0].call_id",
        "expected a string, got null",
    ),
    (
        {
            "tools": [
                {"type": "namespace", "name": "ns", "tools": [{"type": "web_search", "name": "w"}]}
            ]
        },
        "tools[0].tools[0].type",
        "'web_search' is not supported in a namespace (function and custom tools are)",
    ),
    (
        {"tools": [{"type": "namespace", "name": "ns", "tools": [{"name": "a"}, {"name": "a"}]}]},
        "tools[0].tools[1]",
        "declares the tool 'ns.a' a second time",
    ),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name", "expected a non-empty string"),
    (
        {"tools": [{"type": "custom", "name": "c", "description": 5}]},
        "tools[0].description",
        "expected a string, got integer",
    ),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": []}]},
        "tools[0].parameters",
        "expected an object, got array",
    ),
    (
        {"tool_choice": 5},
        "tool_choice",
        "None is not supported ('auto', 'none', 'required' and function choices are)",
    ),
    (
        {"tool_choice": "sometimes"},
        "tool_choice",
        "'sometimes' is not one of 'auto', 'none', 'required' or a function",
    ),
    ({"include": ["a", 1]}, "include", "expected a list of strings"),
    ({"max_output_tokens": "9"}, "max_output_tokens", "expected a positive integer"),
    ({"reasoning": "high"}, "reasoning", "expected an object, got string"),
    ({"text": {"format": "json"}}, "text.format", "expected an object, got string"),
]

CHAT_FIELD_ERRORS: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": None}, "messages", "is required"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "must be a JSON object, got array",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].type",
        "'custom' is not supported (function calls are)",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
        "expected an object, got null",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": 5, "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].id",
        "expected a string, got integer",
    ),
    (
        {
            "messages": [
                {
                    "role": "tool",
                    "tool_call_id": "c",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x"}}],
                }
            ]
        },
        "messages[0].content[0].type",
        "'image_url' is not supported here (accepted: text)",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x"}]}
            ]
        },
        "messages[0].content[0].image_url",
        "expected an http(s) URL or a data: URL",
    ),
    (
        {"messages": [{"role": "robot"}]},
        "messages[0].role",
        "'robot' is not one of 'system', 'developer', 'user', 'assistant', 'tool'",
    ),
    ({"messages": ["hi"]}, "messages[0]", "expected an object, got string"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "expected an object, got null"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
        "tool 'g' is not in tools",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function"},
        },
        "tool_choice.function",
        "expected an object, got null",
    ),
    ({"stop": 5}, "stop", "expected a string or a list of strings"),
    (
        {"stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
        "expected a boolean, got string",
    ),
    ({"max_tokens": 0}, "max_tokens", "expected a positive integer"),
    ({"top_k": -1}, "top_k", "expected a non-negative integer"),
    (
        {"response_format": {"type": "json_schema"}},
        "response_format.type",
        "'json_schema' is not supported; only plain text output is",
    ),
]


@pytest.mark.parametrize(("change", "param", "words"), RESPONSES_FIELD_ERRORS)
def test_responses_shape_errors_are_exact(change: dict[str, Any], param: str, words: str) -> None:
    """A Responses body the converter or a later check refuses: the field and the whole message."""
    with pytest.raises(InvalidRequestError) as caught:
        translator.responses({"model": "m", "input": "hi"} | change)
    assert (caught.value.path, caught.value.message) == (param, f"{param}: {words}")


@pytest.mark.parametrize(("change", "param", "words"), CHAT_FIELD_ERRORS)
def test_chat_shape_errors_are_exact(change: dict[str, Any], param: str, words: str) -> None:
    """The same for Chat Completions bodies."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | change
    with pytest.raises(InvalidRequestError) as caught:
        translator.chat(body)
    assert (caught.value.path, caught.value.message) == (param, f"{param}: {words}")


def test_lenient_fields_stay_lenient() -> None:
    """What the translation reads leniently is not checked: max_tokens where
    max_completion_tokens is set, a reasoning item's parts, a custom tool's format, file_id next
    to an image_url, an assistant's reasoning_content."""
    chat = {
        "model": "m",
        "messages": [{"role": "assistant", "content": "a", "reasoning_content": 5}],
        "max_completion_tokens": 7,
        "max_tokens": "many",
    }
    assert translator.chat(chat).body["max_tokens"] == 7
    body = {
        "model": "m",
        "input": [
            {"type": "reasoning", "summary": "s", "content": [5, {"type": "x"}]},
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "https://x", "file_id": 5}],
            },
        ],
        "tools": [{"type": "custom", "name": "c", "format": 5}],
    }
    request = translator.responses(body)
    assert request.body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}],
        }
    ]
