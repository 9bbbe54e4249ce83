"""The official openai SDK against agentkv on a real llama-server: Responses and Chat Completions,
streaming and not, each with a tool-call round trip.

The default model rarely calls a tool on its own, so the first turn forces the call with
``tool_choice`` naming the function (agentkv sends that as constrained decoding); the second turn
sends the call's output back and must get a text answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.conftest import Live

pytestmark = pytest.mark.engine

MODEL = "agentkv-local"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
}
QUESTION = "What is the weather in Paris? Use the tool."


@pytest.fixture
def client(live: Live) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{live.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
        default_headers={"x-agent-id": "openai-sdk"},
    ) as sdk:
        yield sdk


def test_responses_round_trip_streaming_then_not(client: openai.OpenAI) -> None:
    """A forced call, streamed; its output sent back; a text answer, not streamed."""
    tools: list[Any] = [{"type": "function", **WEATHER}]
    with client.responses.stream(
        model=MODEL,
        input=QUESTION,
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    ) as stream:
        types = [event.type for event in stream]
        first = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments).get("city"), str)

    second = client.responses.create(
        model=MODEL,
        tools=tools,
        max_output_tokens=48,
        input=[
            {"role": "user", "content": QUESTION},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
    )
    assert second.status in ("completed", "incomplete")
    assert second.output_text.strip() or any(i.type == "function_call" for i in second.output)
    assert second.usage is not None and second.usage.input_tokens > 0


def test_chat_round_trip_not_streaming_then_streaming(client: openai.OpenAI) -> None:
    """The same round trip on Chat Completions, the answer streamed with its usage."""
    tools: list[Any] = [{"type": "function", "function": WEATHER}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert isinstance(json.loads(call.function.arguments).get("city"), str)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish and finish[-1] in ("stop", "length", "tool_calls")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert text.strip() or calls


def test_openai_requests_share_the_slot_table(client: openai.OpenAI, live: Live) -> None:
    """Requests of the OpenAI routes are recorded by the same runtime, under their agent."""
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    recent = live.engine_table()["recent"]
    assert any(record["agent"] == "openai-sdk" for record in recent)
