"""ResponsesAssembler and ChatAssembler: reply events → OpenAI streams, checked by the SDK."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension

from agentkv.exceptions import EngineUnavailableError, PromptTooLongError, QueueFullError
from agentkv.openai_sse import (
    CHAT_DONE,
    ChatAssembler,
    ResponsesAssembler,
    encode_chat_chunk,
    encode_response_event,
    openai_error,
)
from agentkv.openai_translate import OpenAITranslator
from agentkv.sse import SSEAssembler

translator = OpenAITranslator()
CREATED = 1_760_000_000

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SPAWN = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}],
}


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def done(reason: str) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
        "timings": {"cache_n": 100, "prompt_n": 20, "predicted_n": 7},
    }


def reply_events(chunks: Sequence[dict[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """The reply events the runtime would emit for these engine chunks."""
    sse = SSEAssembler(message_id="msg_0123abcd", model="m", coalesce_chars=1, **options)
    events = sse.start()
    for chunk in chunks:
        events += sse.feed(chunk, 0.0)
    return events + sse.finish(0.0)


TEXT = [delta(content="Hello"), delta(content=", world"), done("stop")]
THINKING_THEN_TEXT = [delta(reasoning_content="Let me think."), delta(content="Hi"), done("stop")]
CALLS = [
    delta(content="Checking."),
    delta(
        tool_calls=[
            {
                "index": 0,
                "id": "toolu_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":'},
            }
        ]
    ),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
    delta(
        tool_calls=[
            {
                "index": 1,
                "id": "toolu_def",
                "type": "function",
                "function": {"name": "multi_agent_v1.spawn_agent", "arguments": "{}"},
            }
        ]
    ),
    done("tool_calls"),
]
CUT = [delta(content="a long"), done("length")]


def responses_request(**extra: Any) -> Any:
    body = {"model": "m", "input": "hi", "tools": [WEATHER, SPAWN], "stream": True} | extra
    return translator.responses(body)


def chat_request(**extra: Any) -> Any:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    return translator.chat(body | {"stream": True} | extra)


def responses_stream(chunks: Sequence[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    assembler = ResponsesAssembler(responses_request(**extra), created_at=CREATED)
    out: list[dict[str, Any]] = []
    for event in reply_events(chunks):  # one at a time, as they arrive
        out += assembler.feed([event])
    return out


def prune(value: Any) -> Any:
    """``value`` without None fields (the SDK's models fill in every field they know)."""
    if isinstance(value, dict):
        return {k: prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune(v) for v in value]
    return value


def sdk_client(payload: bytes) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=payload)

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(
        api_key="test", base_url="http://agentkv.test/v1", http_client=http, max_retries=0
    )


# -- Responses -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["text", "thinking_then_text", "calls", "cut"], ids=lambda name: name
)
def test_responses_stream_snapshot(name: str, snapshot_json: SnapshotAssertion) -> None:
    """Each kind of reply as the Responses event stream pinned in the snapshot."""
    chunks = {"text": TEXT, "thinking_then_text": THINKING_THEN_TEXT, "calls": CALLS, "cut": CUT}
    assert responses_stream(chunks[name]) == snapshot_json


@pytest.mark.parametrize("chunks", [TEXT, THINKING_THEN_TEXT, CALLS, CUT])
def test_responses_stream_rules(chunks: list[dict[str, Any]]) -> None:
    """sequence_number counts from 0, items are added before their deltas and done after, and
    exactly one terminal event ends the stream."""
    events = responses_stream(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    terminal = {"response.completed", "response.incomplete", "response.failed"}
    assert events[-1]["type"] in terminal
    assert sum(e["type"] in terminal for e in events) == 1
    open_items: set[int] = set()
    for event in events:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert index == len(events[-1]["response"]["output"][:index])
            open_items.add(index)
        elif event["type"] == "response.output_item.done":
            open_items.remove(index)
        elif index is not None:
            assert index in open_items, event
    assert not open_items


def test_the_sdk_accumulates_the_same_response() -> None:
    """The official SDK's stream helper rebuilds, from our bytes, the response we hold."""
    assembler = ResponsesAssembler(responses_request(), created_at=CREATED)
    events = assembler.feed(reply_events(CALLS))
    client = sdk_client(b"".join(encode_response_event(e) for e in events))
    with client.responses.stream(model="m", input="hi") as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen == [e["type"] for e in events]
    ours = assembler.response
    assert final.id == ours["id"] and final.status == "completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.call_id, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", "call_abc", {"city": "Paris"}),
        ("spawn_agent", "call_def", {}),
    ]
    assert calls[1].model_dump().get("namespace") == "multi_agent_v1"
    assert final.output_text == "Checking."
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (120, 7)
    assert final.usage.input_tokens_details.cached_tokens == 100
    assert prune(final.model_dump()) == prune(ours)


def test_non_streaming_is_the_final_snapshot() -> None:
    """Fed all at once, the assembler's response is the one the stream ended with."""
    assembler = ResponsesAssembler(responses_request(), created_at=CREATED)
    events = assembler.feed(reply_events(THINKING_THEN_TEXT))
    assert assembler.response == events[-1]["response"]
    reasoning, message = assembler.response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert message["content"][0]["text"] == "Hi"


def test_failure_is_an_error_then_response_failed() -> None:
    """A request that fails mid-way ends with ``error`` and ``response.failed``."""
    assembler = ResponsesAssembler(responses_request(), created_at=CREATED)
    events = assembler.feed(reply_events(TEXT)[:4])
    events += assembler.fail(EngineUnavailableError("engine gone", retry_after=4.2))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_is_overloaded"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["message"] == "engine gone Please try again in 5s."
    assert assembler.fail(EngineUnavailableError("again")) == []  # ended once


def test_keep_alive_is_an_in_progress_event() -> None:
    assembler = ResponsesAssembler(responses_request(), created_at=CREATED)
    assert assembler.keep_alive() == []  # nothing before the stream starts
    assembler.feed(reply_events(TEXT)[:1])
    (event,) = assembler.keep_alive()
    assert event["type"] == "response.in_progress"


def test_custom_tool_call_is_its_input_string() -> None:
    """A custom tool's call carries the ``input`` string, not the engine's JSON."""
    tool = {"type": "custom", "name": "apply_patch", "description": "Patch."}
    request = translator.responses({"model": "m", "input": "x", "tools": [tool]})
    call = {
        "index": 0,
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'},
    }
    assembler = ResponsesAssembler(request, created_at=CREATED)
    events = assembler.feed(reply_events([delta(tool_calls=[call]), done("tool_calls")]))
    (item,) = assembler.response["output"]
    assert item == {
        "id": item["id"],
        "type": "custom_tool_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "apply_patch",
        "input": "*** Begin Patch",
    }
    assert "response.custom_tool_call_input.done" in [e["type"] for e in events]


# -- Chat Completions ------------------------------------------------------------------------------


def chat_stream(chunks: Sequence[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    assembler = ChatAssembler(chat_request(**extra), created=CREATED)
    return assembler.feed(reply_events(chunks))


@pytest.mark.parametrize("name", ["text", "calls"])
def test_chat_stream_snapshot(name: str, snapshot_json: SnapshotAssertion) -> None:
    """Text and tool calls as the Chat Completions chunks pinned in the snapshot."""
    chunks = {"text": TEXT, "calls": CALLS}[name]
    assert chat_stream(chunks, stream_options={"include_usage": True}) == snapshot_json


def test_the_sdk_accumulates_the_same_completion() -> None:
    """The SDK's chat stream helper rebuilds our non-streaming completion from our chunks."""
    assembler = ChatAssembler(chat_request(stream_options={"include_usage": True}), created=CREATED)
    chunks = assembler.feed(reply_events(CALLS))
    client = sdk_client(b"".join(map(encode_chat_chunk, chunks)) + CHAT_DONE)
    with client.chat.completions.stream(
        model="m", messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    ours = assembler.completion
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert [
        (call.id, call.function.name, call.function.arguments) for call in message.tool_calls or []
    ] == [
        (call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in ours["choices"][0]["message"]["tool_calls"]
    ]
    assert final.usage is not None and final.usage.model_dump() == final.usage.model_dump() | {
        "prompt_tokens": 120,
        "completion_tokens": 7,
        "total_tokens": 127,
    }


def test_chat_without_include_usage_has_no_usage_chunk() -> None:
    chunks = chat_stream(TEXT)
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chat_stream(CUT)[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_failure_is_an_error_chunk_the_sdk_raises() -> None:
    assembler = ChatAssembler(chat_request(), created=CREATED)
    chunks = assembler.feed(reply_events(TEXT)[:4])
    chunks += assembler.fail(EngineUnavailableError("engine gone"))
    client = sdk_client(b"".join(map(encode_chat_chunk, chunks)) + CHAT_DONE)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="engine gone"):
        for _ in stream:
            pass


# -- errors ----------------------------------------------------------------------------------------


def test_openai_error_shapes() -> None:
    """Errors in OpenAI's shape, with the codes clients act on."""
    assert openai_error(PromptTooLongError(40000, 32000)) == {
        "error": {
            "message": "prompt is too long: 40000 tokens > 32000 maximum",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    }
    assert openai_error(QueueFullError("queue is full"))["error"]["code"] == "server_is_overloaded"


def test_frames_hold_one_line_each_whatever_the_text() -> None:
    """Characters that str.splitlines() takes for line ends are escaped in the JSON."""
    text = "a\x85b\u2028c\u2029d"
    frame = encode_response_event({"type": "response.output_text.delta", "delta": text})
    lines = frame.decode().strip().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1].removeprefix("data: "))["delta"] == text
    chunk = encode_chat_chunk({"choices": [{"delta": {"content": text}}]})
    assert len(chunk.decode().strip().splitlines()) == 1
