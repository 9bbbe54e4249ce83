"""LlamaSlotClient against a real llama-server: slot pinning, slot files, tools, cancellation."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
import pytest

from tests._engine_fixture import Engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}

_TOPICS = ["parser", "scheduler", "cache", "router", "logger", "planner", "indexer", "queue"]
_VERBS = ["validate", "retry", "document", "measure", "isolate", "serialise", "stream", "trace"]


def long_prefix(tag: str, lines: int = 45) -> str:
    """A system prompt of roughly 1000 tokens, unique per ``tag`` so tests share no cache."""
    rules = [
        f"Rule {i} ({tag}): the {_TOPICS[i % 8]} module must {_VERBS[(i * 3) % 8]} every "
        f"request it sees before step {i + 7}."
        for i in range(lines)
    ]
    return "You follow these project rules.\n" + "\n".join(rules)


def chat_body(system: str, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def tag() -> str:
    return uuid.uuid4().hex[:8]


async def test_same_slot_serves_prefix_from_cache(engine: Engine) -> None:
    """A second request with the same long prefix on the same slot reuses >= 90% from cache."""
    system = long_prefix(tag())
    first = await engine.client.chat(chat_body(system, "Which rule is first?"), slot=0)
    assert first["timings"]["prompt_n"] > 900
    second = await engine.client.chat(chat_body(system, "Which rule is last?"), slot=0)
    timings = second["timings"]
    total = timings["cache_n"] + timings["prompt_n"]
    assert timings["cache_n"] >= 0.9 * total


async def test_other_slot_recomputes_prefix(engine: Engine) -> None:
    """The same prefix sent to the other slot is prefilled again from scratch."""
    system = long_prefix(tag())
    await engine.client.chat(chat_body(system, "Which rule is first?"), slot=0)
    other = await engine.client.chat(chat_body(system, "Which rule is last?"), slot=1)
    timings = other["timings"]
    assert timings["cache_n"] < 0.1 * (timings["cache_n"] + timings["prompt_n"])


async def test_saved_slot_restores_its_cache(engine: Engine) -> None:
    """save → erase → restore brings a slot's prefix back: the next request is served from cache."""
    client = engine.client
    system = long_prefix(tag())
    body = chat_body(system, "Which rule mentions the cache module?")
    await client.chat(body, slot=1)
    filename = f"warm-{tag()}.bin"
    saved = await client.save_slot(1, filename)
    assert saved["n_saved"] > 900
    await client.erase_slot(1)
    restored = await client.restore_slot(1, filename)
    assert restored["n_restored"] == saved["n_saved"]
    again = await client.chat(body, slot=1)
    timings = again["timings"]
    assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"])


async def test_erased_slot_recomputes(engine: Engine) -> None:
    """After erase (without restore) the same prompt is prefilled again."""
    client = engine.client
    body = chat_body(long_prefix(tag(), lines=20), "Which rule is first?")
    await client.chat(body, slot=0)
    await client.erase_slot(0)
    again = await client.chat(body, slot=0)
    assert again["timings"]["cache_n"] == 0


async def test_forced_tool_call_via_json_schema(engine: Engine) -> None:
    """Constrained decoding with the tool's input_schema yields the tool's arguments."""
    body = {
        "messages": [
            {
                "role": "system",
                "content": "Call the tool get_weather(city) to answer. Reply with its arguments.",
            },
            {"role": "user", "content": "What is the weather in Paris right now?"},
        ],
        "max_tokens": 16,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "get_weather", "schema": WEATHER_SCHEMA},
        },
    }
    reply = await engine.client.chat(body, slot=0)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    arguments = json.loads(choice["message"]["content"])
    assert set(arguments) == {"city"}
    assert "paris" in arguments["city"].lower()


async def test_stream_reports_timings_on_last_chunk(engine: Engine) -> None:
    """A streamed completion ends with a finish_reason and timings on the last chunk."""
    body = chat_body("Be brief.", f"Say the word {tag()}.")
    async with engine.client.stream(body, slot=1) as chunks:
        got = [c async for c in chunks]
    assert got[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert got[-1]["timings"]["predicted_n"] >= 1


async def test_cancelled_stream_frees_slot(engine: Engine) -> None:
    """Cancelling a streaming reader mid-generation makes llama-server stop and free the slot."""
    client = engine.client
    body = chat_body(
        "You are a storyteller.",
        f"Tell a very long story about {tag()}, at least 2000 words.",
        max_tokens=2048,
    )
    seen = 0

    async def read() -> None:
        nonlocal seen
        async with client.stream(body, slot=1) as chunks:
            async for _ in chunks:
                seen += 1
                if seen == 2:
                    busy = next(s for s in await client.slots() if s["id"] == 1)
                    assert busy["is_processing"], "slot 1 should be generating mid-stream"
                if seen >= 3:
                    scope.cancel()

    with anyio.CancelScope() as scope:
        await read()
    assert seen == 3
    cancelled_at = time.monotonic()
    # 2048 tokens take a minute at CPU decode speed; an idle slot within 10 s means it was stopped
    # (a generous bound, because the CI machine is slow and shared).
    deadline = cancelled_at + 10
    while True:
        slot = next(s for s in await client.slots() if s["id"] == 1)
        if not slot["is_processing"]:
            break
        assert time.monotonic() < deadline, "slot 1 still generating after the stream was cancelled"
        await anyio.sleep(0.1)


async def test_prompt_tokens_match_the_engine(engine: Engine) -> None:
    """prompt_tokens counts the prompt tokens llama-server processes for the same body."""
    body = chat_body(
        "You are a coding assistant.",
        f"List the files in directory {tag()}.",
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather in a city.",
                    "parameters": WEATHER_SCHEMA,
                },
            }
        ],
    )
    counted = len(await engine.client.prompt_tokens(body))
    reply = await engine.client.chat(body, slot=0)
    timings = reply["timings"]
    assert counted == timings["prompt_n"] + timings["cache_n"]
    assert counted == reply["usage"]["prompt_tokens"]
