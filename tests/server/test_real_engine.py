"""Conformance and scheduling on a real llama-server, with the official Anthropic SDK as client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import anyio
import httpx
import pytest

from tests.server.conftest import Live

pytestmark = pytest.mark.engine

MODEL = "agentkv-local"  # any name: agentkv answers with the local model and echoes it

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
}

# A long shared prefix (about 800 tokens), as agents sharing one project prompt would send.
RULES = "You are a coding agent on a shared project. Follow the project rules.\n"
SHARED_SYSTEM = RULES + "\n".join(
    f"Rule {i}: module m{i} keeps its public names in __all__, has tests in tests/test_m{i}.py, "
    f"and never imports from module m{i + 1} directly."
    for i in range(24)
)


_opened: list[anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def sdk(live: Live, **headers: str) -> anthropic.Anthropic:
    """A sync SDK client pointed at agentkv (closed after the test)."""
    client = anthropic.Anthropic(
        base_url=live.url, api_key="test", default_headers=headers, max_retries=0, timeout=300
    )
    _opened.append(client)
    return client


def test_sync_create(live: Live) -> None:
    """messages.create through the sync SDK returns a real completion with usage."""
    msg = sdk(live).messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Reply with one word: hello."}],
    )
    assert msg.role == "assistant"
    assert msg.model == MODEL
    assert msg.content and msg.content[0].type == "text"
    assert msg.content[0].text.strip()
    assert msg.stop_reason in {"end_turn", "max_tokens"}
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 5
    assert 0 < msg.usage.output_tokens <= 12


def test_sync_stream_final_message(live: Live) -> None:
    """messages.stream yields text deltas whose sum is the final message's text."""
    with sdk(live).messages.stream(
        model=MODEL,
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count from 1 to 5."}],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed.strip()
    assert final.content[0].type == "text" and final.content[0].text == streamed
    assert final.usage.output_tokens > 0


def test_async_create_and_stream(live: Live) -> None:
    """The async SDK works for create and for stream + get_final_message()."""

    async def run() -> tuple[Any, Any]:
        client = anthropic.AsyncAnthropic(base_url=live.url, api_key="test", max_retries=0)
        try:
            created = await client.messages.create(
                model=MODEL,
                max_tokens=8,
                messages=[{"role": "user", "content": "Say yes."}],
            )
            async with client.messages.stream(
                model=MODEL,
                max_tokens=8,
                messages=[{"role": "user", "content": "Say no."}],
            ) as stream:
                final = await stream.get_final_message()
        finally:
            await client.close()
        return created, final

    created, final = anyio.run(run)
    assert created.content[0].text.strip()
    assert final.content[0].type == "text" and final.content[0].text.strip()


def test_tool_round_trip(live: Live) -> None:
    """A forced tool call comes back as valid tool_use, and the tool_result is answered."""
    client = sdk(live)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body={"temperature": 0},
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    assert call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input.get("city"), str)
    second = client.messages.create(
        model=MODEL,
        max_tokens=24,
        extra_body={"temperature": 0},
        tools=[WEATHER_TOOL],
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 °C"}
                ],
            },
        ],
    )
    texts = [b.text for b in second.content if b.type == "text"]
    assert texts and texts[0].strip()
    assert second.stop_reason in {"end_turn", "max_tokens"}


def test_count_tokens_matches_the_engine(live: Live) -> None:
    """count_tokens equals the prompt tokens the engine reports for the same request."""
    client = sdk(live)
    messages = [{"role": "user", "content": "Explain KV caches in one sentence."}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    # A system prompt nobody else uses, so the engine reports every prompt token.
    reply = client.messages.create(model=MODEL, max_tokens=4, system="Be brief.", messages=messages)
    engine_total = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == engine_total


def test_four_agents_on_two_slots_reuse_their_cache(live: Live) -> None:
    """4 agents x 2 turns on 2 slots: each second turn reads >= 80% of its input from cache."""
    results: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def agent(name: str) -> None:
        try:
            client = sdk(live, **{"X-Agent-Id": name})
            history: list[dict[str, Any]] = [
                {"role": "user", "content": f"I am agent {name}. Which rule covers module m3?"}
            ]
            usages = []
            for turn in range(2):
                msg = client.messages.create(
                    model=MODEL,
                    max_tokens=8,
                    extra_body={"temperature": 0},
                    system=SHARED_SYSTEM,
                    messages=history,
                )
                usages.append(msg.usage)
                history += [
                    {"role": "assistant", "content": msg.content[0].text or "ok"},
                    {"role": "user", "content": f"Turn {turn + 2}: and module m4?"},
                ]
            results[name] = usages
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(f"agent-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for name, (_, second) in results.items():
        cached = second.cache_read_input_tokens or 0
        total = second.input_tokens + cached
        assert cached >= 0.8 * total, (name, second)
    snapshot = live.runtime.snapshot()
    assert all(not slot.busy for slot in snapshot.slots)
    assert snapshot.queue == ()


def test_urgent_request_is_served_before_earlier_background_requests(live: Live) -> None:
    """With both slots busy, a P0 request that arrives after three P2 requests gets a slot first."""
    done: dict[str, int | None] = {}

    def call(name: str, priority: int, max_tokens: int) -> None:
        sdk(live, **{"X-Agent-Id": name, "X-Agent-Priority": str(priority)}).messages.create(
            model=MODEL,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": f"{name}: write a long story about a robot."}],
        )
        done[name] = None

    def wait_for(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition(live.runtime.snapshot()):
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    # Two long generations occupy both slots for many seconds.
    busy = [threading.Thread(target=call, args=(f"busy-{i}", 1, 300)) for i in range(2)]
    for t in busy:
        t.start()
    wait_for(lambda t: all(s.busy for s in t.slots), "both slots busy")
    waiting = [threading.Thread(target=call, args=(f"bg-{i}", 2, 4)) for i in range(3)]
    for i, t in enumerate(waiting):
        t.start()
        wait_for(lambda t, n=i + 1: len(t.queue) == n, "background request queued")
    urgent = threading.Thread(target=call, args=("coordinator", 0, 4))
    urgent.start()
    wait_for(lambda t: len(t.queue) == 4, "urgent request queued")
    for t in [*busy, *waiting, urgent]:
        t.join(timeout=600)
    assert len(done) == 6
    seq = {r.agent: r.dispatch_seq for r in live.runtime.snapshot().recent}
    assert all(seq["coordinator"] < seq[f"bg-{i}"] for i in range(3)), seq


def test_disconnect_mid_stream_frees_the_slot(live: Live) -> None:
    """A client that drops mid-stream frees its slot in agentkv and in llama-server."""
    body = {
        "model": MODEL,
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long essay about compilers."}],
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream(
            "POST", f"{live.url}/v1/messages", json=body, headers={"x-agent-id": "leaver"}
        ) as r,
    ):
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                deltas += 1
                if deltas >= 3:
                    break
    # The connection is closed now. Both agentkv and the engine must let go of the slot.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ours = live.runtime.snapshot().slots
        engine = live.engine_slots()
        if all(not s.busy for s in ours) and not any(s["is_processing"] for s in engine):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"slot still busy: agentkv={ours} engine={engine}")
    recent = live.runtime.snapshot().recent
    assert [r.status for r in recent if r.agent == "leaver"] == ["cancelled"]
    msg = sdk(live).messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Still there?"}]
    )
    assert msg.content[0].text.strip()


def test_auto_mode_tool_call_written_as_text_arrives_as_tool_use(live: Live) -> None:
    """With tools in auto mode the small model writes its call as JSON text; agentkv returns a
    tool_use block with schema-valid input instead."""
    msg = sdk(live).messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body={"temperature": 0},
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "Check the weather in Tokyo."}],
    )
    assert msg.stop_reason == "tool_use"
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input.get("city"), str)


def test_a_degenerate_loop_is_stopped_on_the_real_engine(live: Live) -> None:
    """Asked to repeat a word, the default model loops; agentkv stops the generation long before
    max_tokens, ends the turn as end_turn, and llama-server's slot is free again."""
    started = time.monotonic()
    msg = sdk(live, **{"X-Agent-Id": "looper"}).messages.create(
        model=MODEL,
        max_tokens=1500,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Write the word ok 3000 times separated by spaces"}],
    )
    elapsed = time.monotonic() - started
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert set(text.lower().replace(",", " ").split()) <= {"ok", "ok."}, text[:200]
    assert msg.stop_reason == "end_turn"
    assert 200 < msg.usage.output_tokens < 600
    deadline = time.monotonic() + 20
    while any(s["is_processing"] for s in live.engine_slots()):
        assert time.monotonic() < deadline, "llama-server still generating"
        time.sleep(0.2)
    recent = [r for r in live.runtime.snapshot().recent if r.agent == "looper"]
    assert [r.status for r in recent] == ["ok"]
    print(f"stopped after {msg.usage.output_tokens} tokens, {elapsed:.1f} s")


def test_tiny_capability_probe_is_answered_by_the_engine(live: Live) -> None:
    """A max_tokens=1 probe gets one real generated token, quickly, and is recorded as ok."""
    started = time.monotonic()
    msg = sdk(live, **{"X-Agent-Id": "prober"}).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "quota"}]
    )
    assert time.monotonic() - started < 30
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 1
    recent = [r for r in live.runtime.snapshot().recent if r.agent == "prober"]
    assert [r.status for r in recent] == ["ok"]
    assert recent[0].output_tokens == 1


def test_more_agents_than_slots_get_their_parked_context_back(live: Live) -> None:
    """Three agents take turns on two slots; the one whose slot was taken gets its context
    restored from the prefix store (it was parked there) instead of prefilling it again."""
    notes = {
        name: "\n".join(f"{name} note {i}: the value of k{i} is {i * 7}." for i in range(40))
        for name in ("park-a", "park-b", "park-c")
    }

    def turn(name: str, n: int) -> anthropic.types.Message:
        messages: list[dict[str, Any]] = [{"role": "user", "content": notes[name]}]
        for i in range(n):
            messages += [
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": f"Question {i}: what is k{i}?"},
            ]
        return sdk(live, **{"X-Agent-Id": name}).messages.create(
            model=MODEL, max_tokens=4, system="Answer briefly.", messages=messages
        )

    for name in ("park-a", "park-b", "park-c"):  # c's miss evicts a's slot: a is parked
        turn(name, 0)
    again = turn("park-a", 1)
    records = [r for r in live.runtime.snapshot().recent if r.agent == "park-a"]
    assert records[-1].source == "store"
    cached = again.usage.cache_read_input_tokens or 0
    assert cached >= 0.9 * (again.usage.input_tokens + cached)
    parked = {row["agent"] for row in live.engine_table()["store"]["entries"]}
    assert "park-a" in parked
