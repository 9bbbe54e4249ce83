"""The engine link against a real llama-server: stale connections after streams, and a proxy that
drops half of the requests arriving on reused connections (tests/_link_proxy.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import EngineConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from tests._engine_fixture import ENGINE_CTX_PER_SLOT, ENGINE_SLOTS, Engine
from tests._link_proxy import DropReused

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

PROMPT = {"prompt": "Name one colour.", "n_predict": 4, "temperature": 0}


def upstream(engine: Engine) -> tuple[str, int]:
    parts = urlsplit(engine.base_url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def test_a_call_after_a_stream_never_meets_a_closed_connection(engine: Engine) -> None:
    """40 times a streamed completion read to its end, then a tokenize on the same client (the
    sequence that failed 7 times in 40 with a pooled httpx client): no failure, and agentkv's
    own client (each stream on a connection of its own, the tokenize calls on one kept-alive
    connection) resends nothing. With an injected pooling client, streams close their
    connections, so no call fails either."""
    pooled = httpx.AsyncClient(timeout=120)
    clients = [
        engine.process.client(read_timeout=120),
        engine.process.client(read_timeout=120, http=pooled),
    ]
    try:
        for client in clients:
            for _ in range(40):
                async with client.complete(PROMPT, slot=0) as chunks:
                    async for _chunk in chunks:
                        pass
                assert await client.tokenize("hello") != []
        assert clients[0].link.resent == 0
    finally:
        for client in clients:
            await client.aclose()
        await pooled.aclose()


async def test_a_pooled_client_behind_a_dropping_link_loses_no_call(engine: Engine) -> None:
    """A pooling client behind the proxy: about half of the calls made on a reused connection
    are dropped, and each is sent once more on a new connection; the caller sees no error."""
    host, port = upstream(engine)
    async with DropReused.running(host, port, seed=7) as proxy:
        pooled = httpx.AsyncClient(timeout=120)
        client = LlamaSlotClient(proxy.url, http=pooled, api_key=engine.process.api_key)
        try:
            for i in range(30):
                assert await client.tokenize(f"call {i}") != []
        finally:
            await client.aclose()
            await pooled.aclose()
    assert proxy.dropped >= 5, (proxy.requests, proxy.reused, proxy.dropped)
    assert client.link.resent == proxy.dropped


SHARED = "\n".join(
    f"Rule {i}: the {('parser', 'cache', 'router', 'queue')[i % 4]} module keeps step {i} small."
    for i in range(40)
)


def agent_body(agent: int, turn: int, answer: str = "") -> dict[str, Any]:
    """Agent ``agent``'s request: the shared rules and its task; on turn 2 its answer and a
    follow-up question."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Agent {agent}: in one word, which module has rule {agent}?"}
    ]
    if turn == 2:
        messages += [
            {"role": "assistant", "content": answer or "parser"},
            {"role": "user", "content": "And which rule follows it?"},
        ]
    return {
        "model": "local",
        "max_tokens": 12,
        "temperature": 0,
        "system": SHARED,
        "messages": messages,
        "stream": (agent + turn) % 2 == 0,
    }


def whole_reply(response: httpx.Response) -> str:
    """The text of a clean reply (a 200 with a whole message or a stream to message_stop)."""
    assert response.status_code == 200, response.text[:500]
    if not response.headers["content-type"].startswith("text/event-stream"):
        message = response.json()
        assert message["stop_reason"] in ("end_turn", "max_tokens"), message
        return "".join(b.get("text", "") for b in message["content"])
    text, stopped = "", False
    for frame in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        event = json.loads(fields["data"])
        assert event["type"] != "error", event
        if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text += event["delta"]["text"]
        stopped = stopped or event["type"] == "message_stop"
    assert stopped, response.text[-500:]
    return text


async def test_four_agents_behind_a_dropping_link_get_eight_clean_replies(
    engine: Engine, tmp_path: Path
) -> None:
    """agentkv behind a proxy that drops half of the requests arriving on reused connections
    (seeded), 4 agents × 2 turns on 2 slots with parking on: 8 of 8 replies clean, no lease
    left. (agentkv opens a connection per call, so the proxy finds none reused to drop.)"""
    host, port = upstream(engine)
    running = engine.process.running_config
    assert isinstance(running, EngineConfig) and running.slot_save_dir is not None
    store = running.slot_save_dir
    async with DropReused.running(host, port, seed=17) as proxy:
        client = LlamaSlotClient(proxy.url, api_key=engine.process.api_key, read_timeout=300)
        config = RuntimeConfig(
            n_slots=ENGINE_SLOTS,
            ctx_per_slot=ENGINE_CTX_PER_SLOT,
            store_dir=store,
            park_min=64,
            retry_grace=1.0,
        )
        replies: dict[tuple[int, int], str] = {}
        async with client, Runtime(client, config) as runtime:
            app = create_app(runtime)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://agentkv") as http:

                async def one(agent: int, turn: int) -> None:
                    body = agent_body(agent, turn, replies.get((agent, 1), ""))
                    with anyio.fail_after(600):
                        response = await http.post(
                            "/v1/messages",
                            json=body,
                            headers={"x-agent-id": f"agent-{agent}"},
                            timeout=600,
                        )
                    replies[(agent, turn)] = whole_reply(response)

                for turn in (1, 2):
                    async with anyio.create_task_group() as tg:
                        for agent in range(4):
                            tg.start_soon(one, agent, turn)
            snapshot = runtime.snapshot()
    assert len(replies) == 8
    assert all(not s.busy and not s.leases for s in snapshot.slots), snapshot.slots
    assert snapshot.placements.acquired >= 8
    print(
        f"\nlink: 8/8 replies clean; proxy saw {proxy.requests} requests on "
        f"{proxy.connections} connections, {proxy.reused} on reused ones, {proxy.dropped} dropped; "
        f"resent {client.link.resent}"
    )
