"""The request lifecycle in the runtime, against the fake engine: sharing, store, retries."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.record import RequestStatus
from tests.fakes import FakeLlama, wait_for

pytestmark = pytest.mark.anyio

#: A long shared head (system prompt and session context), as a fresh agent's first request has.
SYSTEM = "You are a careful coding agent. " * 300
NOTE = "<system-reminder>\n# Environment\nWorking directory: /home/dev/shop\n" + "x" * 2000


def first_request(words: str) -> dict[str, Any]:
    """A fresh agent's first request, shaped like Claude Code's: the words, then the note."""
    return {
        "model": "m",
        "max_tokens": 8,
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": words}]},
            {"role": "system", "content": NOTE},
        ],
    }


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def running(fake: FakeLlama, **config: Any) -> AsyncIterator[Runtime]:
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    async with http, Runtime(client, RuntimeConfig(**config)) as runtime:
        yield runtime


async def ask(runtime: Runtime, body: dict[str, Any], agent: str, priority: int = 1) -> str:
    prepared = await runtime.prepare(body, agent=agent, priority=priority)
    message = await runtime.submit(prepared).message()
    return "".join(block.get("text", "") for block in message["content"])


async def test_agents_starting_together_compute_the_shared_head_once(tmp_path: Path) -> None:
    """Three fresh agents on two slots: one computes the head and saves it, the others wait for
    it and restore it; the engine computes the head's tokens once."""
    fake = FakeLlama(reply="ok", save_dir=tmp_path, prefill_delay=0.3)
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        async with anyio.create_task_group() as tg:
            for i, words in enumerate(["alpha", "beta", "gamma"]):
                tg.start_soon(ask, runtime, first_request(f"Reply with: {words}"), f"agent{i}")
        records = {r.agent: r for r in runtime.records()}
        head = records["agent0"].checkpoint_tokens
        assert head is not None and head > 1000
        assert [records[a].checkpoint_tokens for a in ("agent1", "agent2")] == [None, None]
        # The head it computed on its own first counts as computed by it, not as found cached.
        first = records["agent0"]
        assert first.cached_tokens == 0
        assert first.computed_tokens == first.prompt_tokens
        # and its time is in what the computed part cost (the fake: 1 ms a token)
        assert first.divergence is not None
        assert first.divergence["seconds"] >= 0.9 * head / 1000
        assert {records[a].source for a in ("agent1", "agent2")} <= {"store", "slot"}
        # The engine computed the head once, plus each agent's own few tokens.
        prompt = records["agent0"].prompt_tokens
        assert fake.computed < head + 3 * (prompt - head) + 3
        assert all(r.status == "ok" for r in records.values())


async def test_the_store_outlives_a_restart(tmp_path: Path) -> None:
    """After a restart on the same store, a new agent restores the head instead of computing it;
    an index made for another engine configuration is refused and its files deleted."""
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, first_request("one"), "a")
        head = runtime.records()[0].checkpoint_tokens
    assert head is not None
    # The shared head, and (saved at the stop) the agent's context: the head and its own words.
    saved = sorted(p.name for p in tmp_path.glob("akv-*.bin"))
    assert [name.split("-")[1] for name in saved] == ["context", "prefix"]

    fresh = FakeLlama(reply="ok", save_dir=tmp_path)  # an engine with empty slots
    async with running(fresh, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, first_request("two"), "b")
        record = runtime.records()[0]
        assert record.source == "store" and record.cached_tokens >= head
        assert fresh.computed < 20  # its own words only

    # Another model or context size: the entry is refused, deleted, never restored.
    other = FakeLlama(reply="ok", save_dir=tmp_path)
    config = RuntimeConfig(n_slots=2, store_dir=tmp_path, ctx_per_slot=32768)
    http = httpx.AsyncClient(transport=other.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    async with http, Runtime(client, config, store_compat="another model") as runtime:
        assert not list(tmp_path.glob("akv-*.bin"))
        await ask(runtime, first_request("three"), "c")
        assert runtime.records()[0].source == "none"
        assert not any(a == "restore" for _, a, _ in other.slot_actions)


async def test_the_store_stays_within_its_budget(tmp_path: Path) -> None:
    """Writing more than the budget evicts entries; the files of removed entries are gone."""
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    budget = 3 * 1024  # a handful of the fake's small state files
    async with running(
        fake, n_slots=1, store_dir=tmp_path, store_budget=budget, ctx_per_slot=32768, park_min=1
    ) as runtime:
        for i in range(8):
            body = {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"{i} " * 300}],
            }
            await ask(runtime, body, f"agent{i}")
        store = runtime.store
        assert store is not None
        files = list(tmp_path.glob("akv-*.bin"))
        assert sum(p.stat().st_size for p in files) <= budget
        assert sorted(p.stem for p in files) == sorted(e.id for e in store.index.entries())
        assert store.index.stats().evicted > 0
        assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in files)


async def test_a_retry_of_a_running_request_joins_it(tmp_path: Path) -> None:
    """A client that gave up and retried the same request gets the first computation's reply:
    the engine computes it once."""
    fake = FakeLlama(reply="the answer", prefill_delay=0.5)
    async with running(fake, n_slots=1, retry_grace=5) as runtime:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
        first = runtime.submit(await runtime.prepare(body, agent="a", priority=1))
        with anyio.move_on_after(0.1):  # the client times out and goes away
            async for _ in first.events():
                pass
        again = runtime.submit(
            await runtime.prepare({**body, "stream": True}, agent="a", priority=1)
        )
        assert again is first
        message = await again.message()
        assert message["content"][0]["text"] == "the answer"
        assert len([r for r in fake.requests if "messages" in r]) == 1
        assert runtime.records()[-1].attached == 2


async def test_a_request_nobody_follows_is_cancelled_after_the_grace(tmp_path: Path) -> None:
    fake = FakeLlama(reply="x" * 200, chunk_chars=1, delay=0.05)
    async with running(fake, n_slots=1, retry_grace=0.2) as runtime:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
        exchange = runtime.submit(await runtime.prepare(body, agent="a", priority=1))
        with anyio.move_on_after(0.1):
            async for _ in exchange.events():
                pass
        await wait_for(lambda: exchange.done)
        assert exchange.record.status is RequestStatus.CANCELLED
        assert fake.finished == 0
        assert runtime.dispatcher.slots.free == 1


async def test_generation_ends_before_the_clients_timeout() -> None:
    """A reply that would outlast the client's patience is ended in time, whole."""
    fake = FakeLlama(reply="word " * 400, chunk_chars=5, delay=0.02)
    async with running(fake, n_slots=1, client_timeout=10.5) as runtime:  # 0.5 s after margin
        body = {"model": "m", "max_tokens": 4000, "messages": [{"role": "user", "content": "q"}]}
        with anyio.fail_after(5):
            message = await runtime.submit(
                await runtime.prepare(body, agent="a", priority=1)
            ).message()
        assert message["stop_reason"] == "max_tokens"
        assert 0 < len(message["content"][0]["text"]) < len("word " * 400)
        assert runtime.records()[-1].stopped == "deadline"


async def test_a_reply_ended_before_its_timings_still_counts_its_prompt() -> None:
    """The engine sends a call's timings with its last chunk; a reply agentkv ends first (the
    deadline, a degenerate loop) is counted from the prompt progress it saw: the computed and
    cached tokens of a second turn on the same slot, not zeros."""
    fake = FakeLlama(reply="word " * 400, chunk_chars=5, delay=0.02, prefill_delay=0.2)
    async with running(fake, n_slots=1, client_timeout=10.8) as runtime:
        first = {"model": "m", "max_tokens": 4000, "messages": [{"role": "user", "content": "q"}]}
        with anyio.fail_after(5):
            reply = await runtime.submit(
                await runtime.prepare(first, agent="a", priority=1)
            ).message()
        turn = {
            **first,
            "messages": [*first["messages"], reply, {"role": "user", "content": "and then?"}],
        }
        with anyio.fail_after(5):
            await runtime.submit(await runtime.prepare(turn, agent="a", priority=1)).message()
        for record in runtime.records():
            assert record.stopped == "deadline"
            assert record.cached_tokens + record.computed_tokens == record.prompt_tokens, record
        assert runtime.records()[-1].cached_tokens > 0


async def test_a_ticket_cancelled_while_queued_is_withdrawn() -> None:
    """A request whose client leaves while it waits for a slot leaves nothing in the queue."""
    fake = FakeLlama(reply="slow", prefill_delay=1.0)
    async with running(fake, n_slots=1, retry_grace=0) as runtime:
        busy = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "first"}]}
        waiting = {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "second"}],
        }
        first = runtime.submit(await runtime.prepare(busy, agent="a", priority=1))
        second = runtime.submit(await runtime.prepare(waiting, agent="b", priority=1))
        assert len(runtime.snapshot().queue) == 1
        with anyio.move_on_after(0.1):
            async for _ in second.events():
                pass
        await wait_for(lambda: second.done)
        assert runtime.snapshot().queue == ()
        await first.message()
        assert [r["messages"][-1]["content"] for r in fake.requests] == ["first"]


async def test_an_overlong_prompt_waits_for_its_agents_background_compaction() -> None:
    """A prompt too long to fit while the agent's background compaction still waits for a slot:
    the compaction is made urgent and used, instead of 'prompt is too long'."""
    fake = FakeLlama(reply="a short summary", prefill_delay=0.2)
    async with running(
        fake, n_slots=1, ctx_per_slot=1200, compact_at=300, compact_keep_messages=2
    ) as runtime:
        turns: list[dict[str, Any]] = []
        for i in range(12):
            turns += [
                {"role": "user", "content": f"question {i} " + "detail " * 30},
                {"role": "assistant", "content": f"answer {i} " + "fact " * 30},
            ]
        earlier = {"model": "m", "max_tokens": 8, "messages": turns[:11]}
        hog = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hog"}]}
        busy = runtime.submit(await runtime.prepare(hog, agent="hog", priority=1))
        # Long enough to schedule a background compaction, which queues behind the hog.
        first = runtime.submit(await runtime.prepare(earlier, agent="agent", priority=1))
        assert runtime.compactor.store.pending("agent")
        await wait_for(lambda: runtime.snapshot().background)
        # The next turn cannot fit as it stands: it waits for that compaction, made urgent.
        later = {
            "model": "m",
            "max_tokens": 8,
            "messages": [*turns, {"role": "user", "content": "go"}],
        }
        with anyio.fail_after(10):
            await ask(runtime, later, "agent")
        await busy.message()
        await first.message()
        assert runtime.compactor.store.latest("agent") is not None
        sent = fake.requests[-1]["messages"]
        assert sent[-1]["content"] == "go"
        assert "question 0" not in json.dumps(sent)
        # The agent's next turn is rewritten with its compaction at once; another agent with the
        # same conversation has no compaction, and its request goes as it is.
        after = {**later, "messages": [*later["messages"], {"role": "user", "content": "on"}]}
        prepared = await runtime.prepare(after, agent="agent", priority=1)
        assert "question 0" not in json.dumps(prepared.engine.body["messages"])
        other = {**after, "messages": after["messages"][-3:]}
        untouched = await runtime.prepare(other, agent="other", priority=1)
        assert untouched.engine.body["messages"][-1]["content"] == "on"
        assert runtime.compactor.store.latest("other") is None


async def _long_conversation(**config: Any) -> tuple[list[int], int, int]:
    """A client that never compacts: 30 turns, each waiting for agentkv's idle work before the
    next. The prompt each turn sent the engine, the agent's compactions in force at the end, and
    the prompt tokens the engine computed in all."""
    fake = FakeLlama(reply="a short summary of it", prefill_delay=0.01)
    prompts = []
    async with running(fake, n_slots=2, ctx_per_slot=2000, compact_keep_messages=2, **config) as rt:
        messages: list[dict[str, Any]] = []
        for i in range(30):
            messages.append({"role": "user", "content": f"turn {i} " + "detail " * 40})
            body = {"model": "m", "max_tokens": 8, "messages": messages}
            messages.append({"role": "assistant", "content": await ask(rt, body, "agent")})
            prompts.append(rt.records()[-1].prompt_tokens)
            await wait_for(lambda: not rt.compactor.store.pending("agent") and not rt.running())
        held = sum(1 for row in rt.compactor.store.snapshot() if row.agent == "agent")
    return prompts, held, fake.computed


async def test_incremental_compaction_keeps_the_prompt_in_its_band() -> None:
    """Between the low mark (``compact_from``) and the high-water mark, the oldest turns are
    folded into the running summary after each turn past the low mark: once the first fold is in
    force every prompt stays in the band, while the high-water design's saw-tooth spans it; the
    agent's folds never pile up (each stands for the ones before it)."""
    band, band_held, band_computed = await _long_conversation(compact_at=1500, compact_from=1000)
    high, high_held, high_computed = await _long_conversation(compact_at=1500)
    first = next(i for i, p in enumerate(band) if p > 1000)
    assert all(p <= 1000 + 120 for p in band[first + 1 :]), band  # the low mark and one turn
    assert min(band[first + 1 :]) >= 1000 - 500 - 120, band  # a fold takes a quarter band off
    assert max(high) > 1500 and min(high[10:]) < 700, high  # the saw-tooth
    assert band_held == 1 and high_held >= 1
    print(f"engine computed: band {band_computed}, high-water {high_computed} prompt tokens")


async def test_a_compaction_model_writes_the_summary_without_taking_an_agents_slot() -> None:
    """With a second engine for summaries, the summary is written there while the agents' only
    slot is busy; the agents' engine is asked for no summary, only for the compacted
    conversation's prefill, in idle time; the agent's next turn carries that summary."""
    fake = FakeLlama(reply="ok " * 40, delay=0.02)  # the hog's reply takes about a second
    small = FakeLlama(reply="the summary the small model wrote")
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    small_http = httpx.AsyncClient(transport=small.transport(), base_url="http://small")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    summarizer = LlamaSlotClient("http://small", http=small_http, connect_retries=0)
    config = RuntimeConfig(n_slots=1, ctx_per_slot=4000, compact_at=300, compact_keep_messages=2)
    async with http, small_http, Runtime(client, config, summarizer=summarizer) as runtime:
        turns: list[dict[str, Any]] = []
        for i in range(6):
            turns += [
                {"role": "user", "content": f"question {i} " + "detail " * 30},
                {"role": "assistant", "content": f"answer {i} " + "fact " * 30},
            ]
        long = {
            "model": "m",
            "max_tokens": 8,
            "messages": [*turns, {"role": "user", "content": "go"}],
        }
        await ask(runtime, long, "agent")  # past compact_at: a background compaction starts
        hog = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hog"}]}
        busy = runtime.submit(await runtime.prepare(hog, agent="hog", priority=1))
        # the summary is written on the small engine while the hog holds the only slot
        await wait_for(lambda: len(small.requests) == 1)
        assert not busy.done
        assert "Summarise this conversation" in json.dumps(small.requests[0])
        await busy.message()
        await wait_for(lambda: runtime.compactor.store.latest("agent") is not None)
        asked = json.dumps(fake.requests)
        assert "Summarise this conversation" not in asked  # the agents' engine wrote none
        after = {**long, "messages": [*long["messages"], {"role": "user", "content": "on"}]}
        prepared = await runtime.prepare(after, agent="agent", priority=1)
        sent = json.dumps(prepared.engine.body["messages"])
        assert "the summary the small model wrote" in sent and "question 0" not in sent


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}},
    }


async def test_a_miss_is_explained_by_the_section_where_the_prompt_changed() -> None:
    """One tool's description changes between two requests: the record says the prompt parted
    from the cached one at that tool, at which token, and what that cost."""
    fake = FakeLlama(reply="ok")
    tools = [_tool(f"tool{i}", f"Does thing {i}. " * 20) for i in range(4)]
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": "You are an agent. " * 50,
        "tools": tools,
        "messages": [{"role": "user", "content": "go"}],
    }
    async with running(fake, n_slots=1) as runtime:
        await ask(runtime, body, "a")
        changed = [*tools[:2], _tool("tool2", "Does something else now. " * 20), tools[3]]
        await ask(runtime, {**body, "tools": changed}, "a")
        divergence = runtime.records()[-1].divergence
        assert divergence is not None
        assert divergence["section"] == "tool 2 (tool2)"
        assert divergence["candidate"].startswith("slot 0")
        assert (
            0
            < divergence["position"]
            == divergence["reused"]
            < divergence["computed"] + divergence["reused"]
        )


async def test_an_urgent_request_has_the_engine_to_itself(tmp_path: Path) -> None:
    """With a free slot too: a P0 request suspends the P2 prefill running next to it (its
    progress saved), and a P2 request arriving meanwhile waits; both finish afterwards."""
    fake = FakeLlama(reply="done", prefill_delay=0.4, save_dir=tmp_path)
    async with running(fake, n_slots=2, preempt_from=1, store_dir=tmp_path) as runtime:

        async def call(name: str, priority: int) -> None:
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": name}]}
            await ask(runtime, body, name, priority)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "background", 2)
            await wait_for(lambda: fake.started == 1)  # its prefill is under way
            tg.start_soon(call, "coordinator", 0)
            await wait_for(lambda: any(r.agent == "coordinator" for r in runtime.running()))
            tg.start_soon(call, "late", 2)
        records = {r.agent: r for r in runtime.records()}
        assert records["background"].suspended == 1
        assert records["coordinator"].suspended == 0
        assert all(r.status == "ok" for r in records.values())
        # The coordinator ran while neither P2 request computed anything.
        order = [r["messages"][-1]["content"] for r in fake.requests if "messages" in r]
        assert order.index("coordinator") < order.index("late")
        assert order.count("background") == 2  # started, suspended, resumed
        assert "save" in [a for _, a, _ in fake.slot_actions]


async def test_a_reply_suspended_mid_way_continues_where_it_stopped(tmp_path: Path) -> None:
    """A P2 reply that is streaming gives its only slot to a P0 request; it resumes as a
    continuation of its own text, and its client gets one whole reply."""
    first = "one two three four five six seven eight nine ten " * 3

    def resumed(body: dict[str, Any]) -> str:
        # The model, given the reply so far up to its last whitespace, writes the cut-off word
        # again and goes on.
        prefill = body["messages"][-1]["content"]
        return first[len(prefill) :] + "and the rest."

    fake = FakeLlama(
        script=[first, "urgent", resumed], chunk_chars=4, delay=0.03, save_dir=tmp_path
    )
    async with running(fake, n_slots=1, preempt_from=1, store_dir=tmp_path) as runtime:
        replies: dict[str, str] = {}

        async def call(name: str, priority: int) -> None:
            body = {
                "model": "m",
                "max_tokens": 200,
                "messages": [{"role": "user", "content": name}],
            }
            replies[name] = await ask(runtime, body, name, priority)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "background", 2)
            await wait_for(lambda: any(r.ttft_s for r in runtime.running()))  # streaming
            await anyio.sleep(0.2)
            tg.start_soon(call, "coordinator", 0)
        records = {r.agent: r for r in runtime.records()}
        assert records["background"].suspended == 1
        assert replies["coordinator"] == "urgent"
        continuation = fake.requests[-1]["messages"]
        assert continuation[-1]["role"] == "assistant"
        prefill = continuation[-1]["content"]
        # It resumes from the reply so far, cut at its last whitespace.
        assert 0 < len(prefill) < len(first) and first.startswith(prefill)
        assert prefill.endswith(" ")
        # The client gets one whole reply: no word twice, none lost.
        assert replies["background"] == first + "and the rest."
        # Its saved progress is gone once it has ended.
        await wait_for(lambda: not list(tmp_path.glob("akv-suspended-*.bin")))


async def test_an_engine_restart_forgets_what_the_slots_held() -> None:
    """When the supervisor reports a new engine generation, every slot is empty: the runtime
    forgets the cached prompt it remembered, so the next request is not placed on a ghost."""
    from agentkv.runtime.status import EngineStatus

    fake = FakeLlama(reply="ok")
    status = EngineStatus()
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0, status=status)
    async with http, Runtime(client, RuntimeConfig(n_slots=2)) as runtime:
        await ask(runtime, first_request("alpha"), "a")
        held = [len(slot.tokens) for slot in runtime.dispatcher.slots.table()]
        assert max(held) > 1000
        status.new_generation()
        await wait_for(
            lambda: all(not slot.tokens for slot in runtime.dispatcher.slots.table()), timeout=5
        )
        await ask(runtime, first_request("alpha"), "a")
        assert runtime.records()[-1].source == "none"
        assert runtime.records()[-1].planned_reuse == 0


async def test_a_store_switched_off_by_a_park_is_not_used_for_the_restore(tmp_path: Path) -> None:
    """A park whose save llama-server refuses switches the store off; the same request's restore,
    planned with the store, is then not attempted: it prefills."""
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    config = {"n_slots": 1, "store_dir": tmp_path, "ctx_per_slot": 32768, "park_min": 1}

    def body(words: str) -> dict[str, Any]:
        return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}

    async with running(fake, **config) as runtime:
        await ask(runtime, body("first " * 300), "a")
        await ask(runtime, body("second " * 300), "b")  # parks a's context in the store
        assert runtime.records()[-1].parked
        fake.save_dir = None  # llama-server now refuses slot actions (HTTP 501)
        fake.slot_actions.clear()
        assert await ask(runtime, body("first " * 300 + "again"), "a") == "ok"
        record = runtime.records()[-1]
        assert record.status == "ok" and not record.parked
        assert runtime.store is None  # switched off by the refused park
        assert [action for _, action, _ in fake.slot_actions] == ["save"]
        assert record.source == "none"


async def test_the_watchdog_leaves_a_request_alone_while_the_engine_reports_progress() -> None:
    """A request that runs for four times lease_ttl, its engine sending a chunk every 0.1 s,
    keeps its lease and gets its whole reply; the watchdog reclaims nothing."""
    reply = "tick " * 16  # 20 chunks of 4 characters, 0.1 s apart: about 2 s
    fake = FakeLlama(reply=reply, chunk_chars=4, delay=0.1)
    async with running(fake, n_slots=1, lease_ttl=0.5, watchdog_interval=0.05) as runtime:
        body = {**first_request("go"), "max_tokens": 200}
        assert await ask(runtime, body, "slow") == reply
        assert runtime.dispatcher.snapshot().placements.reclaimed == 0


async def test_the_watchdog_reclaims_a_lease_whose_engine_falls_silent() -> None:
    """An engine that sends nothing for longer than lease_ttl loses the lease: the watchdog's
    reason to exist (a hung engine, a leaked lease) still holds."""
    fake = FakeLlama(reply="late", prefill_delay=2.4)  # progress 0.6 s apart
    async with running(fake, n_slots=1, lease_ttl=0.5, watchdog_interval=0.05) as runtime:
        task_done = anyio.Event()

        async def slow() -> None:
            await ask(runtime, first_request("go"), "silent")
            task_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await wait_for(lambda: runtime.dispatcher.snapshot().placements.reclaimed >= 1, 3.0)
            await task_done.wait()


async def test_finished_replies_are_kept_for_a_retry() -> None:
    """Within retry_grace a finished reply is kept for the client's retry, and a retry of its
    request gets it; its bounds are the Joinable's own (tests/runtime/test_joinable.py)."""
    fake = FakeLlama(reply="ok")
    async with running(fake, retry_grace=60.0) as runtime:
        bodies = [
            {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"q{i}"}]}
            for i in range(3)
        ]
        replies = []
        for body in bodies:
            exchange = runtime.submit(await runtime.prepare(body, agent="a", priority=1))
            await exchange.message()
            replies.append(exchange)
        assert list(runtime.joinable) == replies
        assert runtime.joinable.get(replies[0].prepared.key) is replies[0]
