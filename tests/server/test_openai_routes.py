"""/v1/responses and /v1/chat/completions against a fake engine, read by the official openai SDK.

Both routes go through the same runtime as /v1/messages: the fake sees an ordinary engine request,
and the slot table records the request under the agent the client's headers name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes import FakeLlama

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent.parent / "fixtures"
WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
RESPONSES_TOOL = {"type": "function", **WEATHER_FUNCTION}
CHAT_TOOL = {"type": "function", "function": WEATHER_FUNCTION}
CALL_AS_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sdk(http: httpx.AsyncClient, **options: Any) -> openai.AsyncOpenAI:
    """The official SDK, talking to the in-process app."""
    return openai.AsyncOpenAI(
        api_key=options.pop("api_key", "unused"),
        base_url="http://agentkv/v1",
        http_client=httpx.AsyncClient(transport=http._transport, base_url="http://agentkv"),
        max_retries=0,
        **options,
    )


def records(http: httpx.AsyncClient) -> list[Any]:
    return http.runtime.records()  # type: ignore[attr-defined,no-any-return]


# -- /v1/responses ---------------------------------------------------------------------------------


async def test_responses_non_streaming_text(serve: Any) -> None:
    """A plain request gets a completed Response whose output_text is the engine's reply."""
    fake = FakeLlama(reply="Hello there.")
    client = sdk(await serve(fake))
    response = await client.responses.create(model="m", input="Say hello.", instructions="Be kind.")
    assert response.status == "completed"
    assert response.output_text == "Hello there."
    assert response.id.startswith("resp_")
    assert response.usage is not None and response.usage.output_tokens > 0
    sent = fake.requests[0]["messages"]
    assert sent[0] == {"role": "system", "content": "Be kind."}
    assert sent[-1]["content"] == "Say hello."


async def test_responses_stream_with_tool_round_trip(serve: Any) -> None:
    """A streamed call (written as text by the model, repaired) goes back with its output."""
    fake = FakeLlama(script=[CALL_AS_TEXT, "It is sunny in Oslo."])
    http = await serve(fake)
    client = sdk(http)
    async with client.responses.stream(
        model="m", input="Weather in Oslo?", tools=[RESPONSES_TOOL]
    ) as stream:
        types = [event.type async for event in stream]
        first = await stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in types
    assert types[-1] == "response.completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})

    second = await client.responses.create(
        model="m",
        tools=[RESPONSES_TOOL],
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )
    assert second.output_text == "It is sunny in Oslo."
    sent = fake.requests[1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


async def test_responses_forced_function_uses_constrained_decoding(serve: Any) -> None:
    """tool_choice naming a function is sent as a JSON schema, and the reply is that call."""
    fake = FakeLlama(reply='{"city": "Paris"}')
    client = sdk(await serve(fake))
    response = await client.responses.create(
        model="m",
        input="Weather in Paris?",
        tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert "response_format" in fake.requests[0] and "tools" not in fake.requests[0]


async def test_codex_request_is_one_agent_in_the_slot_table(serve: Any) -> None:
    """Codex's captured request streams an answer, recorded under Codex's thread id."""
    captured = json.loads((FIXTURES / "codex_first_request.json").read_text())
    fake = FakeLlama(reply="alpha")
    http = await serve(fake, ctx_per_slot=32768)
    r = await http.post("/v1/responses", json=captured["body"], headers=captured["headers"])
    assert r.status_code == 200, r.text
    frames = [f for f in r.text.strip().split("\n\n") if f]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "alpha"
    (record,) = records(http)
    assert record.agent == json.loads(captured["headers"]["x-codex-turn-metadata"])["thread_id"]


async def test_headers_name_the_agent_and_its_priority(serve: Any) -> None:
    """X-Agent-Id and X-Agent-Priority work on the OpenAI routes as on /v1/messages."""
    http = await serve(FakeLlama())
    client = sdk(http, default_headers={"x-agent-id": "aider-1", "x-agent-priority": "0"})
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    (record,) = records(http)
    assert (record.agent, record.priority) == ("aider-1", 0)


# -- /v1/chat/completions --------------------------------------------------------------------------


async def test_chat_non_streaming_tool_round_trip(serve: Any) -> None:
    """A call comes back as tool_calls; its result in a tool message reaches the engine."""
    fake = FakeLlama(script=[CALL_AS_TEXT, "Sunny."])
    client = sdk(await serve(fake))
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    assert second.choices[0].message.content == "Sunny."
    assert fake.requests[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call.id,
        "content": "sunny",
    }


async def test_chat_stream_with_usage(serve: Any) -> None:
    """A streamed completion ends with a finish reason, then the usage chunk, then [DONE]."""
    http = await serve(FakeLlama(reply="one two three"))
    client = sdk(http)
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    raw = await http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    assert raw.text.endswith("data: [DONE]\n\n")


# -- errors ----------------------------------------------------------------------------------------


async def test_errors_are_openai_shaped(serve: Any) -> None:
    """Refusals on the OpenAI routes are {"error": {message, type, param, code}}."""
    http = await serve(FakeLlama())
    r = await http.post(
        "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "r"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "previous_response_id"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await http.post(
        "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.get("/v1/responses")
    assert r.status_code == 405 and "error" in r.json() and "type" not in r.json()
    client = sdk(http)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], n=3
        )
    assert caught.value.param == "n"  # type: ignore[attr-defined]


async def test_api_key_errors_are_openai_shaped(serve: Any) -> None:
    http = await serve(FakeLlama(), api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        await sdk(http, api_key="wrong").responses.create(model="m", input="x")
    response = await sdk(http, api_key="sekrit").responses.create(model="m", input="x")
    assert response.status == "completed"


async def test_prompt_too_long_is_context_length_exceeded(serve: Any) -> None:
    """A prompt that cannot fit gets the code Codex and the SDK know."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=200, compaction=False)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk(http).responses.create(model="m", input="word " * 400)
    assert caught.value.code == "context_length_exceeded"
    assert fake.requests == []


async def test_a_later_limit_names_the_client_field(serve: Any) -> None:
    """A limit the runtime checks on the Messages body is reported on the OpenAI field."""
    http = await serve(FakeLlama())
    r = await http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stop": ["s" * 2000],
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stop[0]"


async def test_engine_failure_mid_stream_is_response_failed(serve: Any) -> None:
    """An engine that breaks off mid-reply ends the Responses stream with response.failed."""
    http = await serve(FakeLlama(truncate=True, reply="abcdefgh"))
    r = await http.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})
    assert r.status_code == 200
    types = [json.loads(f.split("data: ", 1)[1])["type"] for f in r.text.strip().split("\n\n")]
    assert types[-2:] == ["error", "response.failed"]
    assert all(not slot.busy for slot in http.runtime.snapshot().slots)  # type: ignore[attr-defined]


async def test_models_list_reads_as_openai(serve: Any) -> None:
    http = await serve(FakeLlama())
    models = await sdk(http).models.list()
    assert [m.id for m in models.data] == ["agentkv-local"]


async def test_a_codex_sub_agent_hangs_under_its_parent_thread(serve: Any) -> None:
    """A thread Codex spawned (parent_thread_id) is a sub-agent of the spawning thread's agent."""
    captured = json.loads((FIXTURES / "codex_first_request.json").read_text())
    fake = FakeLlama(reply="alpha")
    http = await serve(fake, ctx_per_slot=32768)
    parent = json.loads(captured["headers"]["x-codex-turn-metadata"])["thread_id"]
    r = await http.post("/v1/responses", json=captured["body"], headers=captured["headers"])
    assert r.status_code == 200, r.text
    child = {"session_id": parent, "thread_id": "child-thread", "parent_thread_id": parent}
    headers = {**captured["headers"], "x-codex-turn-metadata": json.dumps(child)}
    r = await http.post("/v1/responses", json=captured["body"], headers=headers)
    assert r.status_code == 200, r.text
    first, second = records(http)
    assert (first.agent, first.parent) == (parent, None)
    assert (second.agent, second.parent) == (f"{parent}/child-thread", parent)
    tree = http.runtime.snapshot().tree  # type: ignore[attr-defined]
    assert [row.agent for row in tree] == [parent, f"{parent}/child-thread"]
