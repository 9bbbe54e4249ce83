"""The server's routes, errors and scheduling against a fake engine (fast; faults injected)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.snapshot import RuntimeSnapshot
from agentkv_server import create_app
from tests.fakes import FakeLlama, tokenize, wait_for
from tests.test_sse import sdk_final_message

pytestmark = pytest.mark.anyio

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Say hello."}],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sse_events(raw: str) -> list[dict[str, Any]]:
    events = []
    for frame in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append(data)
    return events


def snapshot(http: httpx.AsyncClient) -> RuntimeSnapshot:
    return http.runtime.snapshot()  # type: ignore[attr-defined,no-any-return]


async def test_non_streaming_reply_is_an_anthropic_message(serve: Any) -> None:
    """A non-streaming request returns the engine's text as one Anthropic message."""
    fake = FakeLlama(reply="Hello there, agent.")
    http = await serve(fake)
    r = await http.post("/v1/messages", json=BODY)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["id"].startswith("msg_")
    assert msg["model"] == "claude-sonnet-4-5"
    assert [b["type"] for b in msg["content"]] == ["text"]
    assert msg["content"][0]["text"] == "Hello there, agent."
    assert msg["stop_reason"] == "end_turn"
    assert msg["usage"]["output_tokens"] > 0
    assert snapshot(http).slots[0].busy is False


async def test_streaming_events_come_in_anthropic_order(serve: Any) -> None:
    """A streamed reply is message_start, one text block, message_delta, message_stop."""
    http = await serve(FakeLlama(reply="one two three four five"))
    r = await http.post("/v1/messages", json={**BODY, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in sse_events(r.text) if e["type"] != "ping"]
    types = [e["type"] for e in events]
    assert types[0] == "message_start"
    assert types[1] == "content_block_start"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "one two three four five"


async def test_query_string_is_ignored(serve: Any) -> None:
    """Claude Code's ``?beta=true`` reaches the same route."""
    http = await serve(FakeLlama())
    r = await http.post("/v1/messages?beta=true", json=BODY)
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "empty"),
        (json.dumps({"model": "m", "max_tokens": 5}).encode(), "messages"),
        (json.dumps({**BODY, "max_tokens": "lots"}).encode(), "max_tokens"),
        (
            json.dumps({**BODY, "messages": [{"role": "robot", "content": "hi"}]}).encode(),
            "messages[0].role",
        ),
        (json.dumps({**BODY, "messages": "hello"}).encode(), "messages"),
    ],
)
async def test_malformed_bodies_get_400_naming_the_field(
    serve: Any, content: bytes, needle: str
) -> None:
    """Bad JSON, wrong types, missing messages and unknown roles are 400s that say where."""
    fake = FakeLlama()
    http = await serve(fake)
    r = await http.post(
        "/v1/messages", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]
    assert fake.requests == []


async def test_bad_priority_header_is_a_400(serve: Any) -> None:
    """X-Agent-Priority outside 0..3 is refused, naming the header."""
    http = await serve(FakeLlama())
    r = await http.post("/v1/messages", json=BODY, headers={"x-agent-priority": "7"})
    assert r.status_code == 400
    assert "x-agent-priority" in r.json()["error"]["message"]


async def test_api_key_is_required_when_configured(serve: Any) -> None:
    """With an API key set, requests need it as x-api-key or a Bearer token."""
    http = await serve(FakeLlama(), api_key="sekrit")
    r = await http.post("/v1/messages", json=BODY)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = await http.post("/v1/messages", json=BODY, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    r = await http.post("/v1/messages", json=BODY, headers={"x-api-key": "sekrit"})
    assert r.status_code == 200
    r = await http.post("/v1/messages", json=BODY, headers={"authorization": "Bearer sekrit"})
    assert r.status_code == 200


async def test_oversized_body_gets_413(serve: Any) -> None:
    """A body over the limit is refused with request_too_large before it is parsed."""
    fake = FakeLlama()
    http = await serve(fake, max_body_bytes=1000)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = await http.post("/v1/messages", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "request_too_large"
    assert fake.requests == []


async def test_unknown_route_is_an_anthropic_404(serve: Any) -> None:
    """Unknown paths answer with the Anthropic error shape."""
    http = await serve(FakeLlama())
    r = await http.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


async def test_models_and_count_tokens(serve: Any) -> None:
    """/v1/models lists one model; count_tokens counts the engine's templated prompt."""
    http = await serve(FakeLlama(), model_name="local-qwen")
    r = await http.get("/v1/models")
    assert r.json()["data"][0]["id"] == "local-qwen"
    body = {"model": "m", "messages": [{"role": "user", "content": "count me please"}]}
    r = await http.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    # The fake engine tokenizes four characters of the templated prompt into one token.
    assert r.json()["input_tokens"] == len(tokenize("<user>count me please"))


async def test_queue_cap_gives_529_overloaded(serve: Any) -> None:
    """With the slot busy and the queue full, one more request is refused with 529."""
    fake = FakeLlama(prefill_delay=0.5)
    http = await serve(fake, n_slots=1, max_queue=1)
    results: list[int] = []

    async def call() -> None:
        results.append((await http.post("/v1/messages", json=BODY)).status_code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)  # takes the slot
        await anyio.sleep(0.05)
        tg.start_soon(call)  # waits in the queue
        await anyio.sleep(0.05)
        r = await http.post("/v1/messages", json=BODY)
        assert r.status_code == 529
        assert r.json()["error"]["type"] == "overloaded_error"
    assert results == [200, 200]


async def test_urgent_request_overtakes_queued_background_work(serve: Any) -> None:
    """A P0 request arriving after several P2 requests is served before them."""
    fake = FakeLlama(prefill_delay=0.2)
    http = await serve(fake, n_slots=1)

    async def call(name: str, priority: int) -> None:
        body = {**BODY, "messages": [{"role": "user", "content": name}]}
        r = await http.post("/v1/messages", json=body, headers={"x-agent-priority": str(priority)})
        assert r.status_code == 200

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first", 1)
        await anyio.sleep(0.05)
        for i in range(3):
            tg.start_soon(call, f"background-{i}", 2)
            await anyio.sleep(0.01)
        tg.start_soon(call, "coordinator", 0)
    order = [r["messages"][-1]["content"] for r in fake.requests]
    assert order[0] == "first"
    assert order[1] == "coordinator"
    assert sorted(order[2:]) == ["background-0", "background-1", "background-2"]
    assert fake.max_per_slot == 1


async def test_pings_flow_while_waiting_for_prefill(serve: Any) -> None:
    """A slow prefill is bridged with ping events, so the client never sees a silent stream."""
    http = await serve(FakeLlama(prefill_delay=0.6, reply="ok"), ping_interval=0.1)
    r = await http.post("/v1/messages", json={**BODY, "stream": True})
    types = [e["type"] for e in sse_events(r.text)]
    assert types[0] == "message_start"
    first_block = types.index("content_block_start")
    assert types[1:first_block].count("ping") >= 3


async def test_engine_error_before_stream_is_an_error_status(serve: Any) -> None:
    """An engine 500 on a non-streaming request is an Anthropic api_error, and the slot is freed."""
    http = await serve(FakeLlama(fail_status=500))
    r = await http.post("/v1/messages", json=BODY)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "api_error"
    assert "injected failure" in r.json()["error"]["message"]
    assert all(s.busy is False for s in snapshot(http).slots)


async def test_engine_error_in_stream_is_an_error_event(serve: Any) -> None:
    """Once a stream has started, an engine failure arrives as an ``error`` event."""
    http = await serve(FakeLlama(truncate=True, reply="abcdefgh"))
    r = await http.post("/v1/messages", json={**BODY, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] in {"api_error", "overloaded_error"}
    assert all(s.busy is False for s in snapshot(http).slots)


async def test_unreachable_engine_is_a_clear_error_not_a_hang(serve: Any) -> None:
    """With nothing listening upstream, the client gets an error response promptly."""
    client = LlamaSlotClient("http://127.0.0.1:9", connect_retries=1, retry_seconds=1.0)
    runtime = Runtime(client)
    app = create_app(runtime)
    async with (
        runtime,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as http,
    ):
        with anyio.fail_after(10):
            r = await http.post("/v1/messages", json=BODY)
    assert r.status_code >= 500
    assert r.json()["type"] == "error"
    assert "llama-server" in r.json()["error"]["message"]
    await client.aclose()


async def test_client_disconnect_cancels_engine_and_frees_slot(serve: Any) -> None:
    """A client that goes away mid-stream cancels the upstream request and releases its lease
    (at once here: no grace period for a retry)."""
    fake = FakeLlama(reply="x" * 400, chunk_chars=1, delay=0.01)
    http = await serve(fake, n_slots=1, retry_grace=0)
    app, runtime = http.app, http.runtime
    sent: list[dict[str, Any]] = []
    disconnect = anyio.Event()
    body = json.dumps({**BODY, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if sum(1 for m in sent if m.get("body")) >= 5:
            disconnect.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/messages",
        "raw_path": b"/v1/messages",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-agent-id", b"quitter")],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8788),
        "scheme": "http",
        "root_path": "",
    }
    with anyio.fail_after(5):
        await app(scope, receive, send)
    await wait_for(lambda: runtime.snapshot().recent)
    assert fake.started == 1 and fake.finished == 0
    assert all(s.busy is False for s in runtime.snapshot().slots)
    assert runtime.snapshot().recent[-1].status == "cancelled"
    # The next request is unaffected.
    fake.delay = 0
    r = await http.post("/v1/messages", json=BODY)
    assert r.status_code == 200


async def test_slot_table_shows_agents_and_hits(serve: Any) -> None:
    """/agentkv/slots shows the slot, its agent, and a prefix hit on the agent's second turn."""
    http = await serve(FakeLlama(reply="fine"))
    turn1 = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
    turn2 = {
        **BODY,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "and now?"},
        ],
    }
    for body in (turn1, turn2):
        r = await http.post("/v1/messages", json=body, headers={"x-agent-id": "frontend"})
        assert r.status_code == 200
    view = (await http.get("/agentkv/slots")).json()
    used = [s for s in view["slots"] if s["agent"] == "frontend"]
    assert len(used) == 1 and used[0]["busy"] is False
    assert view["placements"]["from_slot"] == 1
    first, second = view["recent"]
    assert (first["source"], first["planned_reuse"]) == ("none", 0)
    # The second turn starts with the first one's prompt: all of it is reused, in tokens.
    assert second["source"] == "slot"
    assert second["planned_reuse"] == len(tokenize("<user>hi"))
    assert second["cached_tokens"] == second["planned_reuse"]
    assert view["agents"]["frontend"]["requests"] == 2


async def test_prompt_that_cannot_fit_gets_the_prompt_too_long_400(serve: Any) -> None:
    """An oversize prompt gets exactly 'prompt is too long: N tokens > M maximum', unsent."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=200, compaction=False)
    big = {**BODY, "messages": [{"role": "user", "content": "word " * 400}]}
    r = await http.post("/v1/messages", json=big)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    tokens = len(tokenize("<user>" + "word " * 400))
    assert err["message"] == f"prompt is too long: {tokens} tokens > {200 - 64} maximum"
    assert fake.requests == []


async def test_max_tokens_is_capped_to_what_the_slot_can_hold(serve: Any) -> None:
    """Claude Code's max_tokens of 32000 becomes what is left of the slot's context."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=1000)
    r = await http.post("/v1/messages", json={**BODY, "max_tokens": 32000})
    assert r.status_code == 200
    tokens = len(tokenize("<user>Say hello."))
    assert fake.requests[0]["max_tokens"] == 1000 - tokens


async def test_background_work_waits_for_every_foreground_request() -> None:
    """A background (compaction) ticket gets a slot only when no agent request waits."""
    from agentkv.runtime.dispatcher import Dispatcher

    # Aging so fast that, in one queue, the waiting compaction would outrank everything.
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1, aging=100.0))
    order: list[str] = []

    async def run(name: str, priority: int, background: bool) -> None:
        ticket = dispatcher.submit(name, priority, background=background)
        lease = await dispatcher.wait(ticket)
        try:
            order.append(name)
            await anyio.sleep(0.05)
        finally:
            dispatcher.release(lease, holds=ticket.tokens)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "busy", 1, False)
        await anyio.sleep(0.01)
        tg.start_soon(run, "compaction", 3, True)
        await anyio.sleep(0.01)
        tg.start_soon(run, "late-p2", 2, False)
        await anyio.sleep(0.01)
        tg.start_soon(run, "late-p1", 1, False)
    assert order[0] == "busy" and order[-1] == "compaction"
    assert sorted(order[1:3]) == ["late-p1", "late-p2"]
    assert dispatcher.slots.free == 1


WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


async def test_tool_call_written_as_text_is_returned_as_tool_use(serve: Any) -> None:
    """The model's JSON-as-text call (with a trailing comma) arrives as a valid tool_use."""
    fake = FakeLlama(
        script=['```json\n{"name": "get_weather", "arguments": {"city": "Oslo",}}\n```']
    )
    http = await serve(fake)
    r = await http.post("/v1/messages", json={**BODY, "tools": [WEATHER]})
    msg = r.json()
    assert msg["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("input")) for b in msg["content"]] == [("tool_use", {"city": "Oslo"})]
    assert len(fake.requests) == 1


async def test_broken_tool_call_is_retried_once_with_constrained_decoding(serve: Any) -> None:
    """An unrecoverable call is asked for again, constrained to a declared tool, exactly once."""
    fake = FakeLlama(
        script=[
            '{"name": "weather", "arguments": {"city": "Oslo"}}',
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        ]
    )
    http = await serve(fake)
    r = await http.post("/v1/messages", json={**BODY, "stream": True, "tools": [WEATHER]})
    events = [e for e in sse_events(r.text) if e["type"] != "ping"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["tool_use"]
    assert len(fake.requests) == 2
    first, second = fake.requests
    assert "tools" in first and "response_format" not in first
    # The tools stay (the template renders them either way): the retry's prompt is the first
    # one's up to the added note, so the engine finds all of that cached.
    assert second["tools"] == first["tools"] and second["tool_choice"] == "none"
    assert second["response_format"]["type"] == "json_schema"
    view = snapshot(http)
    record = view.recent[-1]
    assert record.retried is True
    # The slot holds the retry's prompt now: of the request's own tokens those the engine found
    # cached for the retry (on a chat template that closes the user's turn after its text, all
    # but the last few; this fake's template has no closing tokens, so all of them).
    held = view.slots[record.slot].tokens
    assert 0 < held <= record.prompt_tokens, (held, record.prompt_tokens)


async def test_tool_repair_can_be_switched_off(serve: Any) -> None:
    """With tool repair off, the model's text passes through untouched."""
    reply = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    fake = FakeLlama(script=[reply])
    http = await serve(fake, tool_repair=False)
    r = await http.post("/v1/messages", json={**BODY, "tools": [WEATHER]})
    assert r.json()["content"] == [{"type": "text", "text": reply}]


async def test_p0_suspends_a_background_request_in_its_prefill(serve: Any, tmp_path: Path) -> None:
    """With the only slot in a P2 request's prefill, a P0 request takes it: the P2 request's
    progress is saved, it queues again, resumes and completes, and its client sees one clean
    reply."""
    fake = FakeLlama(prefill_delay=1.0, reply="done", save_dir=tmp_path)
    http = await serve(fake, n_slots=1, preempt_from=2, store_dir=tmp_path)
    results: dict[str, Any] = {}

    async def call(name: str, priority: int) -> None:
        body = {**BODY, "stream": True, "messages": [{"role": "user", "content": name}]}
        headers = {"x-agent-priority": str(priority), "x-agent-id": name}
        results[name] = await http.post("/v1/messages", json=body, headers=headers)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "background", 2)
        await anyio.sleep(0.2)  # the P2 request is in its (fake) prefill
        tg.start_soon(call, "coordinator", 0)
    order = [r["messages"][-1]["content"] for r in fake.requests]
    assert order == ["background", "coordinator", "background"]
    for name in ("background", "coordinator"):
        events = [e for e in sse_events(results[name].text) if e["type"] != "ping"]
        assert events[0]["type"] == "message_start"
        assert events[-1]["type"] == "message_stop"
        assert sum(e["type"] == "content_block_start" for e in events) == 1
    records = {r.agent: r for r in snapshot(http).recent}
    assert records["background"].suspended == 1
    assert records["coordinator"].suspended == 0
    assert [action for _, action, _ in fake.slot_actions].count("save") >= 1
    assert snapshot(http).slots[0].busy is False


async def test_a_reply_suspended_mid_stream_reaches_its_client_whole(
    serve: Any, tmp_path: Path
) -> None:
    """A streaming P2 reply gives its slot to P0 and continues later: its client's SSE stream is
    one valid message (the official SDK accumulates it), with pings while it waited."""
    fake = FakeLlama(
        script=["x" * 40, "urgent", "y" * 10], chunk_chars=1, delay=0.02, save_dir=tmp_path
    )
    http = await serve(fake, n_slots=1, preempt_from=2, store_dir=tmp_path, ping_interval=0.05)
    raw: dict[str, str] = {}

    async def call(name: str, priority: int) -> None:
        body = {**BODY, "stream": True, "messages": [{"role": "user", "content": name}]}
        headers = {"x-agent-priority": str(priority), "x-agent-id": name}
        raw[name] = (await http.post("/v1/messages", json=body, headers=headers)).text

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "background", 2)
        await wait_for(lambda: fake.started == 1)
        await anyio.sleep(0.3)  # streaming by now
        tg.start_soon(call, "coordinator", 0)
    events = sse_events(raw["background"])
    assert [e["type"] for e in events].count("message_start") == 1
    assert events[-1]["type"] == "message_stop"
    message = sdk_final_message(events)
    text = message.content[0].text  # type: ignore[union-attr]
    assert text.startswith("x") and text.endswith("y" * 10) and set(text) == {"x", "y"}
    assert {r.agent: r.suspended for r in snapshot(http).recent} == {
        "coordinator": 0,
        "background": 1,
    }


async def test_a_looping_reply_is_stopped_and_its_engine_stream_closed(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A degenerate loop ends the message early, as a normal end_turn, and the engine stream is
    dropped before its end (llama-server then stops generating); the log says which agent looped
    and on what (docs/troubleshooting.md)."""
    fake = FakeLlama(reply="ok " * 3000, chunk_chars=3)
    http = await serve(fake)
    r = await http.post("/v1/messages", json={**BODY, "stream": True})
    events = [e for e in sse_events(r.text) if e["type"] != "ping"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert set(text.split()) == {"ok"}
    assert 800 <= len(text) < 3000
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert events[-2]["usage"]["output_tokens"] > 0
    assert (fake.started, fake.finished) == (1, 0)
    assert snapshot(http).recent[-1].status == "ok"
    said = [r.getMessage() for r in caplog.records if r.name == "agentkv.runtime"]
    assert any(
        re.fullmatch(
            r"agent \S+: degenerate repetition in the text: 'ok ' repeated \d+ times .*", m
        )
        for m in said
    ), said
