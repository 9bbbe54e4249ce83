"""Chaos at the engine link: faults injected at the transport seam into every kind of engine call.

A fake llama-server (tests/fakes.py) sits behind a transport that, for a seeded share of the calls,
injects one fault: the connection refused; reset before the reply, on a new connection
(``ReadError``) and on a reused one (``RemoteProtocolError``, what a pooled connection llama-server
had closed gives); reset mid-stream or mid-body; a slow engine; a 502 or 503. Whatever follows a
fault (the retry, or the continuation of a reply) goes through, as it would on a real link where
faults are rare and independent.

What must hold: every client gets its whole reply (no error), no lease or queued ticket is left,
and no prompt is computed twice (the prompt tokens the engine computed are those of the same run
without faults, plus at most the few tokens a resent or continued call evaluates again).

``AGENTKV_CHAOS_ROUNDS`` sets how many seeds the long run uses (default 3; docs/reliability.md
has the figures of a long run).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv.snapshot import RuntimeSnapshot
from tests.fakes import FakeLlama, served, wait_for

pytestmark = pytest.mark.anyio

ROUNDS = int(os.environ.get("AGENTKV_CHAOS_ROUNDS", "3"))
REPLY = "The answer is forty-two, as it was before the link broke."
#: A shared head long enough to be computed as a checkpoint and saved (the fake tokenizer makes
#: one token of four characters).
SYSTEM = "You are a careful coding agent in a shared repository. " * 90
STREAMS = ("/v1/chat/completions", "/completion")
FAULTS = ("refused", "reset_fresh", "reset_reused", "mid_stream", "slow", "502", "503")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def continuing(body: dict[str, Any]) -> str:
    """The fake's reply: REPLY, or the rest of it when the request continues a reply (the fake
    streams the given beginning back first, as llama-server does)."""
    last = body["messages"][-1]
    if last.get("role") == "assistant" and isinstance(last.get("content"), str):
        assert REPLY.startswith(last["content"]), last["content"]
        return REPLY[len(last["content"]) :]
    return REPLY


class _Broken(httpx.AsyncByteStream):
    """A reply body that delivers ``keep`` chunks of ``inner`` and then breaks off."""

    def __init__(self, inner: AsyncIterator[bytes], keep: int) -> None:
        self.inner = inner
        self.keep = keep

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        async for piece in self.inner:
            if sent >= self.keep:
                break
            yield piece
            sent += 1
        raise httpx.ReadError("[Errno 104] Connection reset by peer")


class ChaosLink:
    """The fake engine behind a transport that injects faults into a seeded share of the calls.

    A faulted call's next attempt (same call: same body, or the same slot for a generation)
    goes through, so each fault is met once, as the link's retries and continuations expect.
    """

    def __init__(self, fake: FakeLlama, *, seed: int, rate: float) -> None:
        self.fake = fake
        self.random = random.Random(seed)
        self.rate = rate
        self.injected: Counter[tuple[str, str]] = Counter()
        self.calls: Counter[str] = Counter()
        self._spared: set[tuple[Any, ...]] = set()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    @staticmethod
    def _key(request: httpx.Request) -> tuple[Any, ...]:
        path = request.url.path
        if path in STREAMS:
            # A continuation differs from the cut call but runs on the same (leased) slot.
            return (path, json.loads(request.content).get("id_slot"))
        return (request.method, str(request.url), request.content)

    def _faults(self, request: httpx.Request) -> tuple[str, ...]:
        path = request.url.path
        if path == "/health":
            return ()  # the supervisor's probe is not part of a request
        if path in STREAMS:
            # A generation behind a 502 may have run, and a non-streamed one that broke did:
            # neither is repeated, so neither is injected here.
            if json.loads(request.content).get("stream"):
                return tuple(f for f in FAULTS if f != "502")
            return ("refused", "reset_fresh", "reset_reused", "slow", "503")
        return FAULTS

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        kind = path if not path.startswith("/slots/") else f"slot {request.url.params['action']}"
        self.calls[kind] += 1
        key = self._key(request)
        faults = self._faults(request)
        if key in self._spared or not faults or self.random.random() >= self.rate:
            self._spared.discard(key)
            return await self.fake.handle(request)
        self._spared.add(key)
        fault = self.random.choice(faults)
        self.injected[(kind, fault)] += 1
        if fault == "refused":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if fault == "reset_fresh":
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        if fault == "reset_reused":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if fault == "502":
            return httpx.Response(502, text="bad gateway")
        if fault == "503":
            return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model"}})
        if fault == "slow":
            await anyio.sleep(self.random.uniform(0.05, 0.3))
            return await self.fake.handle(request)
        response = await self.fake.handle(request)
        if response.status_code != 200:
            return response
        try:
            whole = response.content
        except httpx.ResponseNotRead:
            # A stream: cut after a few of its chunks (during prefill, or mid-reply).
            keep = self.random.randint(0, 6)
            return httpx.Response(
                200, headers=response.headers, stream=_Broken(response.stream, keep)
            )  # type: ignore[arg-type]
        cut = whole[: self.random.randint(0, max(0, len(whole) - 1))]
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=_Broken(_once(cut), 1)
        )


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def conversation(agent: int, turn: int) -> dict[str, Any]:
    """Agent ``agent``'s request at ``turn`` (1 or 2): the shared system prompt, its own task,
    and on turn 2 its first answer and a tool result."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Task {agent}: " + f"look into module {agent}. " * 40}
    ]
    if turn == 2:
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": REPLY},
                    {"type": "tool_use", "id": f"toolu_{agent}", "name": "Read", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{agent}",
                        "content": f"line {agent}\n" * 60,
                    }
                ],
            },
        ]
    return {
        "model": "m",
        "max_tokens": 64,
        "system": SYSTEM,
        "messages": messages,
        "stream": (agent + turn) % 2 == 0,
    }


def reply_text(response: httpx.Response) -> str:
    """The text of a whole reply, streamed or not; fails on an error or an unfinished stream."""
    assert response.status_code == 200, response.text[:500]
    if not response.headers["content-type"].startswith("text/event-stream"):
        message = response.json()
        return "".join(b["text"] for b in message["content"] if b["type"] == "text")
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


async def run_agents(
    fake: FakeLlama, store: Path, *, seed: int | None, rate: float, together: bool
) -> tuple[list[str], ChaosLink | None, RuntimeSnapshot]:
    """4 agents × 2 turns on 2 slots with the prefix store on: the replies' texts, the chaos
    link (None without faults) and the runtime's snapshot afterwards."""
    link = None if seed is None else ChaosLink(fake, seed=seed, rate=rate)
    texts: list[str] = []
    settings: dict[str, Any] = {
        "n_slots": 2,
        "ctx_per_slot": 16384,
        "store_dir": store,
        "retry_grace": 0.5,
    }
    transport = None if link is None else link.transport()
    async with served(fake, transport=transport, connect_retries=3, **settings) as http:

        async def one(agent: int, turn: int) -> None:
            headers = {"x-agent-id": f"agent-{agent}"}
            with anyio.fail_after(60):
                response = await http.post(
                    "/v1/messages", json=conversation(agent, turn), headers=headers
                )
            texts.append(reply_text(response))

        for turn in (1, 2):
            if together:
                async with anyio.create_task_group() as tg:
                    for agent in range(4):
                        tg.start_soon(one, agent, turn)
            else:
                for agent in range(4):
                    await one(agent, turn)
        snapshot = http.runtime.snapshot()  # type: ignore[attr-defined]
    return texts, link, snapshot


def assert_idle(snapshot: RuntimeSnapshot) -> None:
    """No slot busy, no lease held, nothing queued."""
    assert all(not s.busy and not s.leases for s in snapshot.slots), snapshot.slots
    assert snapshot.queue == () and snapshot.background == ()


def fake_engine(store: Path) -> FakeLlama:
    return FakeLlama(script=[continuing] * 1000, save_dir=store)


@pytest.mark.parametrize("seed", range(ROUNDS))
async def test_faults_at_the_link_cost_no_client_an_error_nor_a_prompt(
    seed: int, tmp_path: Path
) -> None:
    """One agent at a time (so runs compare token for token): with a third of the engine calls
    faulted, every reply is whole and the prompts computed are those of a clean run."""
    clean_fake = fake_engine(tmp_path / "clean")
    (tmp_path / "clean").mkdir()
    clean, _, table = await run_agents(
        clean_fake, tmp_path / "clean", seed=None, rate=0, together=False
    )
    assert_idle(table)

    fake = fake_engine(tmp_path / "chaos")
    (tmp_path / "chaos").mkdir()
    texts, link, table = await run_agents(
        fake, tmp_path / "chaos", seed=seed, rate=0.33, together=False
    )
    assert link is not None
    assert texts == clean == [REPLY] * 8
    assert_idle(table)
    faults = sum(link.injected.values())
    assert faults >= 5, link.injected
    # A generation sent again (or continued) evaluates a few tokens again; nothing more.
    generations = sum(n for (kind, _), n in link.injected.items() if kind in STREAMS)
    assert fake.computed - clean_fake.computed <= generations * (len(REPLY) // 4 + 2), (
        fake.computed,
        clean_fake.computed,
        link.injected,
    )
    print(f"\nchaos seed {seed}: {faults} faults {dict(link.injected)}; 8/8 replies whole")


@pytest.mark.parametrize("seed", range(ROUNDS))
async def test_faults_with_agents_at_once(seed: int, tmp_path: Path) -> None:
    """Four agents at once on two slots (parking, checkpoints, restores), a third of the engine
    calls faulted: 8 of 8 replies whole, and nothing left held."""
    fake = fake_engine(tmp_path)
    texts, link, table = await run_agents(fake, tmp_path, seed=100 + seed, rate=0.33, together=True)
    assert texts == [REPLY] * 8
    assert_idle(table)
    assert link is not None and sum(link.injected.values()) >= 5
    faults = sum(link.injected.values())
    print(f"\nchaos together seed {seed}: {faults} faults {dict(link.injected)}; 8/8 whole")


async def test_every_kind_of_call_and_fault_is_met(tmp_path: Path) -> None:
    """Across a few seeded runs, the faults reach every kind of engine call the runtime makes
    (templating, tokenizing, generation, prefill, slot save and restore) and every fault kind."""
    kinds: set[str] = set()
    faults: set[str] = set()
    for seed in range(4):
        store = tmp_path / str(seed)
        store.mkdir()
        _, link, _ = await run_agents(
            fake_engine(store), store, seed=200 + seed, rate=0.5, together=True
        )
        assert link is not None
        kinds |= {kind for kind, _ in link.injected}
        faults |= {fault for _, fault in link.injected}
    assert {"/apply-template", "/tokenize", "/v1/chat/completions", "slot save"} <= kinds, kinds
    assert faults == set(FAULTS), faults


async def test_an_engine_that_is_down_is_a_clean_error(tmp_path: Path) -> None:
    """Where the engine really is down (every connection refused), the client gets an
    Anthropic-shaped 503 soon, and nothing is left held."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    async with served(FakeLlama(), transport=httpx.MockTransport(refuse), n_slots=2) as http:
        with anyio.fail_after(30):
            response = await http.post("/v1/messages", json=conversation(0, 1))
        assert response.status_code == 503
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "cannot reach llama-server" in error["error"]["message"]
        assert_idle(http.runtime.snapshot())  # type: ignore[attr-defined]


class Scripted:
    """The fake engine behind a transport that fails the calls a test names, ``times`` times."""

    def __init__(self, fake: FakeLlama, fault: str, which: str, times: int) -> None:
        self.fake = fake
        self.fault = fault
        self.which = which
        self.times = times
        self.seen: Counter[str] = Counter()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        kind = path if not path.startswith("/slots/") else f"slot {request.url.params['action']}"
        self.seen[kind] += 1
        if kind != self.which or self.times <= 0:
            return await self.fake.handle(request)
        self.times -= 1
        if self.fault == "drop":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        response = await self.fake.handle(request)
        # Cut the stream after its first three chunks: the reply has begun.
        return httpx.Response(200, headers=response.headers, stream=_Broken(response.stream, 3))  # type: ignore[arg-type]


async def two_agents(fake: FakeLlama, store: Path, link: Scripted | None) -> list[str]:
    """Two fresh agents sharing the long system prompt, at once, on two slots: the first
    computes the shared head as a checkpoint, the second waits for it."""
    transport = None if link is None else link.transport()
    async with served(
        fake, transport=transport, n_slots=2, store_dir=store, ctx_per_slot=16384
    ) as http:

        async def one(agent: int, texts: list[str]) -> None:
            response = await http.post(
                "/v1/messages", json=conversation(agent, 1), headers={"x-agent-id": f"a{agent}"}
            )
            texts.append(reply_text(response))

        texts: list[str] = []
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0, texts)
                await anyio.sleep(0.05)
                tg.start_soon(one, 1, texts)
        assert_idle(http.runtime.snapshot())  # type: ignore[attr-defined]
    return texts


@pytest.mark.parametrize("times", [2, 3, 10])
async def test_a_failed_head_save_costs_no_error_and_no_second_computation(
    times: int, tmp_path: Path
) -> None:
    """The shared head's save dropped ``times`` times (2: the client's resend fails too; 3: the
    runtime's second save fails as well; 10: saving never works): no client sees an error, and
    the head is computed once — restored from the store, or reused in the slot that holds it."""
    clean_store, store = tmp_path / "clean", tmp_path / "faulty"
    clean_store.mkdir()
    store.mkdir()
    clean = fake_engine(clean_store)
    assert await two_agents(clean, clean_store, None) == [REPLY, REPLY]
    fake = fake_engine(store)
    link = Scripted(fake, "drop", "slot save", times)
    assert await two_agents(fake, store, link) == [REPLY, REPLY]
    assert link.seen["/completion"] == 1  # the head was computed as a checkpoint, once
    assert fake.computed <= clean.computed + 1, (fake.computed, clean.computed)


async def test_a_reply_cut_mid_stream_is_continued_whole(tmp_path: Path) -> None:
    """A reply whose stream breaks after it began is continued from its text on the same slot:
    the client gets the whole reply once, no error, and the prompt is not computed again."""
    clean = fake_engine(tmp_path)
    async with served(clean, n_slots=2) as http:
        reply_text(await http.post("/v1/messages", json=conversation(0, 1)))
    fake = fake_engine(tmp_path)
    link = Scripted(fake, "cut", "/v1/chat/completions", 1)
    async with served(fake, transport=link.transport(), n_slots=2) as http:
        for stream in (False, True):
            link.times = 1
            body = {**conversation(0, 1), "stream": stream}
            assert reply_text(await http.post("/v1/messages", json=body)) == REPLY
        assert_idle(http.runtime.snapshot())  # type: ignore[attr-defined]
    assert link.seen["/v1/chat/completions"] == 4  # each reply: the cut call and its continuation
    continued = fake.requests[1]["messages"][-1]
    assert continued["role"] == "assistant" and REPLY.startswith(continued["content"])
    # Computed again: the one token every call evaluates, and the reply's few words so far.
    assert fake.computed - clean.computed <= 2 * (len(REPLY) // 4 + 2)


async def test_a_tcp_link_dropping_reused_connections_loses_no_call() -> None:
    """Over real TCP: the fake engine served by uvicorn behind the proxy that drops half of the
    requests arriving on reused connections. A pooling client loses none of 40 calls (each drop
    is sent once more on a new connection); neither does agentkv's own client, whose tokenize
    calls share a kept-alive connection and whose streams never reuse one."""
    import uvicorn

    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.engine import free_port
    from tests._link_proxy import DropReused

    fake = FakeLlama()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            fake.asgi, host="127.0.0.1", port=port, log_level="warning", interface="asgi3"
        )
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        await wait_for(lambda: server.started, timeout=10)
        async with DropReused.running("127.0.0.1", port, seed=3) as proxy:
            pooled = httpx.AsyncClient()
            async with LlamaSlotClient(proxy.url, http=pooled) as client:
                for i in range(40):
                    assert await client.tokenize(f"call {i}")
                await pooled.aclose()
            assert proxy.dropped >= 5 and client.link.resent == proxy.dropped
            dropped, reused = proxy.dropped, proxy.reused
            async with LlamaSlotClient(proxy.url) as own:
                for i in range(20):
                    assert await own.tokenize(f"call {i}")
                    await _drain_chat(own)
            # Only tokenize calls came on a reused connection: each drop was one of them.
            own_reused, own_dropped = proxy.reused - reused, proxy.dropped - dropped
            assert 5 <= own_reused <= 19 and own.link.resent == own_dropped >= 1
            assert own.link.requests == 40 + own_dropped
        server.should_exit = True
    print(f"\nproxy: {proxy.requests} requests, {proxy.reused} reused, {proxy.dropped} dropped")


async def _drain_chat(client: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with client.stream(body, slot=0) as chunks:
        async for _ in chunks:
            pass
