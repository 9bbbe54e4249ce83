"""Prepared compaction in the runtime, against the fake engine, with Claude Code's captured
requests (tests/fixtures/claude_code_compaction): the turn's reply ends past the compaction point,
the compaction request is generated in idle time and served when Claude Code sends it exactly."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest

from agentkv.reply import Delta
from agentkv.runtime.admission import Prepared
from agentkv.runtime.broadcast import Emitted
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Exchange, Runtime
from agentkv.runtime.prepared import Preparations
from agentkv.translate import MessagesTranslator
from tests.fakes import FakeLlama, render, tokenize, wait_for
from tests.test_claude_code_compaction import FIRST_LINE, RETRY_PARAGRAPH, exchanges

pytestmark = pytest.mark.anyio

AGENT = "session-1"
SUMMARY = "<analysis>\nThe user asked for words.\n</analysis>\n\n<summary>\n1. Words.\n</summary>"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def turn() -> dict[str, Any]:
    """Claude Code's second turn ("beta"), whose reply crossed the point in the capture."""
    return copy.deepcopy(exchanges("turns")[1]["body"])


def compaction() -> dict[str, Any]:
    """The compaction request Claude Code sent after the fake's reply "beta", byte for byte."""
    return copy.deepcopy(exchanges("turns")[2]["body"])


def window() -> int:
    """A slot size whose Claude Code compaction point is the turn's prompt, as the fake counts
    it: the turn's reply ends past the point (and the compaction request still fits)."""
    prompt = len(tokenize(render(MessagesTranslator().translate(turn()).body)))
    return prompt + 4096 + 13000


def engine(**kwargs: Any) -> FakeLlama:
    """The turn answers "beta" (as the capture's stub did), a compaction request ``SUMMARY``."""

    def answer(body: dict[str, Any]) -> str:
        last = str(body["messages"][-1].get("content"))
        return SUMMARY if last.startswith(FIRST_LINE) else "beta"

    return FakeLlama(script=[answer] * 20, **kwargs)


def compactions_generated(fake: FakeLlama) -> int:
    return sum(
        1
        for body in fake.requests
        if "messages" in body and str(body["messages"][-1].get("content")).startswith(FIRST_LINE)
    )


@asynccontextmanager
async def running(fake: FakeLlama, **config: Any) -> AsyncIterator[Runtime]:
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    settings: dict[str, Any] = {"n_slots": 1, "ctx_per_slot": window(), **config}
    async with http, Runtime(client, RuntimeConfig(**settings)) as runtime:
        yield runtime


async def send(runtime: Runtime, body: dict[str, Any], agent: str = AGENT) -> Exchange:
    return runtime.submit(await runtime.prepare(body, agent=agent, priority=1))


def text(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message["content"])


async def joined_batches(exchange: Exchange) -> list[str]:
    """The text of each batch of events a client that joins ``exchange`` reads: the first within
    0.5 s (everything generated so far, at once), then the rest as it comes."""
    batches: list[str] = []
    async with aclosing(exchange.events()) as events:
        with anyio.fail_after(0.5):
            first = await anext(events)
        assert isinstance(first, Emitted)
        batches.append("".join(e.value for e in first.events if isinstance(e, Delta)))
        async for item in events:
            if isinstance(item, Emitted):
                batches.append("".join(e.value for e in item.events if isinstance(e, Delta)))
    return batches


def prepared(runtime: Runtime) -> Exchange:
    (exchange,) = runtime.preparations.running()
    return exchange


async def test_the_compaction_request_is_served_from_the_prepared_reply() -> None:
    """The turn ends past the point: the compaction is generated in the background, and Claude
    Code's compaction request (its cache_control mark moved) gets that reply; the engine
    generated it once."""
    fake = engine()
    async with running(fake) as runtime:
        assert text(await (await send(runtime, turn())).message()) == "beta"
        await wait_for(lambda: runtime.preparations.stats().prepared == 1)
        await wait_for(lambda: compactions_generated(fake) == 1 and not runtime.running())
        assert runtime.preparations.stats().waiting == 1
        exchange = await send(runtime, compaction())
        assert exchange.done  # finished before it was asked for
        assert text(await exchange.message()) == SUMMARY
        stats = runtime.preparations.stats()
        assert (stats.served, stats.joined, stats.waiting) == (1, 0, 0)
        assert sum(stats.missed.values()) == 0 and stats.wasted_tokens == 0
        assert compactions_generated(fake) == 1
        # the compaction's own reply predicts nothing more
        await anyio.sleep(0.05)
        assert runtime.preparations.stats().prepared == 1


async def test_a_request_one_byte_off_is_not_served_and_the_preparation_stops() -> None:
    fake = engine(delay=0.05)  # the summary takes about 1 s to generate
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.running())
        background = prepared(runtime)
        await wait_for(lambda: background.record.generated > 2)
        changed = compaction()
        changed["messages"][-1]["content"] += "."
        exchange = await send(runtime, changed)
        assert exchange is not background
        assert text(await exchange.message()) == SUMMARY  # computed for this request
        await wait_for(lambda: background.done)
        assert background.record.status == "cancelled"
        stats = runtime.preparations.stats()
        assert stats.missed["differs"] == 1 and stats.served + stats.joined == 0
        assert 0 < stats.wasted_tokens < len(SUMMARY) // 4
        assert compactions_generated(fake) == 2


async def test_a_request_that_is_no_compaction_is_a_miss_of_its_own() -> None:
    fake = engine()
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.stats().waiting == 1)
        await wait_for(lambda: not runtime.running())
        other = turn()
        other["messages"][-1]["content"][-1]["text"] = "Reply with the single word: again"
        await (await send(runtime, other)).message()
        stats = runtime.preparations.stats()
        assert stats.missed["not_compaction"] == 1 and stats.waiting == 0
        assert stats.wasted_tokens > 0  # the whole summary, generated for nothing


async def test_a_client_arriving_mid_generation_gets_what_is_generated_at_once() -> None:
    fake = engine(delay=0.05, chunk_chars=2)  # about 2 s for the summary
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.running())
        background = prepared(runtime)
        await wait_for(lambda: background.record.generated >= 10)
        before = "".join(e.value for e in background.emitted if isinstance(e, Delta))
        assert before and len(before) < len(SUMMARY)
        exchange = await send(runtime, compaction())
        assert exchange is background and not exchange.done
        batches = await joined_batches(exchange)
        assert batches[0].startswith(before)
        assert len(batches) > 2  # then the rest, live
        assert "".join(batches) == SUMMARY
        stats = runtime.preparations.stats()
        assert (stats.joined, stats.served) == (1, 0)
        assert compactions_generated(fake) == 1


async def test_an_agents_request_is_not_held_behind_a_preparation() -> None:
    """One slot, a preparation generating for seconds: another agent's request gets the slot at
    once; without a store to suspend it in, the preparation is stopped (and counted)."""
    fake = engine(delay=0.1, chunk_chars=1)  # about 8 s for the summary
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.running())
        background = prepared(runtime)
        await wait_for(lambda: background.record.generated >= 3)
        other = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with anyio.fail_after(2.0):
            assert text(await (await send(runtime, other, agent="other")).message()) == "beta"
        await wait_for(lambda: background.done)
        assert background.gave_way
        stats = runtime.preparations.stats()
        assert stats.missed["gave_way"] == 1 and stats.waiting == 0
        assert stats.wasted_tokens > 0


async def test_a_suspended_preparation_comes_back_in_the_background(tmp_path: Path) -> None:
    """With the prefix store, a preparation that gives its slot up is suspended and resumes in
    the background lane afterwards; its request is then still served from it."""
    fake = engine(delay=0.05, chunk_chars=2, save_dir=tmp_path)
    async with running(fake, store_dir=tmp_path) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.running())
        background = prepared(runtime)
        await wait_for(lambda: background.record.generated >= 3)
        other = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with anyio.fail_after(3.0):
            foreground = await send(runtime, other, agent="other")
            # suspended, it waits in the background lane, not in the agents' queue
            await wait_for(lambda: runtime.dispatcher.snapshot().background)
            (row,) = runtime.dispatcher.snapshot().background
            assert row.agent == AGENT and not runtime.dispatcher.snapshot().queue
            await foreground.message()
        assert background.record.suspended == 1 and not background.done
        await wait_for(lambda: background.done, 10.0)
        assert background.failure is None
        exchange = await send(runtime, compaction())
        assert exchange is background
        assert text(await exchange.message()) == SUMMARY
        assert runtime.preparations.stats().served == 1


async def test_nothing_is_prepared_with_the_setting_off() -> None:
    fake = engine()
    async with running(fake, prepare_compaction=False) as runtime:
        await (await send(runtime, turn())).message()
        await anyio.sleep(0.1)
        assert runtime.preparations.stats().prepared == 0
        assert not runtime.preparations.running()
        assert compactions_generated(fake) == 0
        await (await send(runtime, compaction())).message()
        assert compactions_generated(fake) == 1


async def test_a_preparation_still_queued_is_promoted_to_its_clients_priority() -> None:
    """One slot, busy with another agent: the preparation waits in the background lane; its
    request arrives, and it moves to the agents' queue at the client's priority and runs next."""
    fake = engine(delay=0.2)
    async with running(fake) as runtime:
        first = await send(runtime, turn())
        other = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        busy = await send(runtime, other, agent="other")  # queued behind the turn
        await first.message()
        await wait_for(lambda: runtime.dispatcher.snapshot().background)
        background = prepared(runtime)
        assert background.record.slot is None  # never had a slot
        exchange = await send(runtime, compaction())
        assert exchange is background
        snapshot = runtime.dispatcher.snapshot()
        assert not snapshot.background
        assert [(row.agent, row.priority) for row in snapshot.queue] == [(AGENT, 1)]
        assert text(await exchange.message()) == SUMMARY
        await busy.message()
        assert runtime.preparations.stats().joined == 1
        assert compactions_generated(fake) == 1


def summary_on_retry(body: dict[str, Any]) -> str:
    """A turn answers "beta"; a compaction gets no <summary> the first time, its retry one."""
    last = str(body["messages"][-1].get("content"))
    if not last.startswith(FIRST_LINE):
        return "beta"
    return SUMMARY if last.endswith(RETRY_PARAGRAPH) else "<analysis>\nWords.\n</analysis>"


async def test_a_compaction_without_summary_has_its_retry_prepared_behind_it() -> None:
    """The prepared compaction's reply has no <summary>: Claude Code's retry (the instruction and
    its paragraph) is prepared too, in idle time, and the agent's next two requests are both
    served from what was prepared; the engine generated each once."""

    fake = FakeLlama(script=[summary_on_retry] * 20)
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.stats().prepared == 2)
        await wait_for(lambda: compactions_generated(fake) == 2 and not runtime.running())
        assert runtime.preparations.stats().waiting == 2
        first = await send(runtime, compaction())
        assert first.done and "<summary>" not in text(await first.message())
        retry = compaction()
        retry["messages"][-1]["content"] += RETRY_PARAGRAPH
        second = await send(runtime, retry)
        assert second.done and text(await second.message()) == SUMMARY
        stats = runtime.preparations.stats()
        assert (stats.prepared, stats.served, stats.waiting) == (2, 2, 0)
        assert sum(stats.missed.values()) == 0
        assert compactions_generated(fake) == 2
        # a reply with its summary predicts no retry
        await anyio.sleep(0.05)
        assert runtime.preparations.stats().prepared == 2


async def test_a_live_compaction_without_summary_has_its_retry_prepared() -> None:
    """Preparation missed the compaction (it was asked for at once): its reply has no summary,
    so the retry is prepared as soon as the reply ends, and the client's retry takes it."""

    fake = FakeLlama(script=[summary_on_retry] * 20)
    async with running(fake, prepare_compaction=True) as runtime:
        # The compaction straight away, as another agent's first: nothing was prepared for it.
        live = await send(runtime, compaction(), agent="other")
        assert "<summary>" not in text(await live.message())
        await wait_for(lambda: runtime.preparations.stats().prepared == 1)
        retry = compaction()
        retry["messages"][-1]["content"] += RETRY_PARAGRAPH
        served = await send(runtime, retry, agent="other")
        assert text(await served.message()) == SUMMARY
        stats = runtime.preparations.stats()
        assert stats.served + stats.joined == 1 and sum(stats.missed.values()) == 0
        assert compactions_generated(fake) == 2


@pytest.mark.parametrize("edited", [False, True])
async def test_the_conversation_after_a_prepared_compaction_is_computed_in_idle_time(
    edited: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The prepared compaction's reply has its summary: the conversation Claude Code starts after
    it is computed in idle time too, up to the user's next words, so that the turn after the
    compaction (as Claude Code sent it in the capture) computes only those words. When the turn
    is not the one computed (``edited``: its summary message differs by one word), it computes
    what differs, and the miss is counted and logged with where it parted."""
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", "<home>/.claude")  # as the captures write it
    captured = exchanges("turns")[2]["answer"]["message"]["content"][0]["text"]

    def answer(body: dict[str, Any]) -> str:
        last = str(body["messages"][-1].get("content"))
        return captured if last.startswith(FIRST_LINE) else "beta"

    fake = FakeLlama(script=[answer] * 20)
    async with running(fake) as runtime:
        await (await send(runtime, turn())).message()
        await wait_for(lambda: runtime.preparations.stats().heads == 1)
        # the turn, the prepared compaction, the conversation after it: all three ended
        await wait_for(lambda: len(runtime.records()) == 3)
        assert runtime.records()[-1].priority == 3 and runtime.records()[-1].status == "ok"
        served = await send(runtime, compaction())
        assert served.done and text(await served.message()) == captured
        after = copy.deepcopy(exchanges("turns")[3]["body"])
        if edited:
            block = after["messages"][0]["content"][1]
            block["text"] = block["text"].replace("Summary:", "Summary (edited):", 1)
        before = fake.computed
        with caplog.at_level(logging.INFO, logger="agentkv.prepared"):
            await (await send(runtime, after)).message()
        record = runtime.records()[-1]
        words = len(tokenize("Reply with the single word: gamma"))
        assert fake.computed - before == record.computed_tokens
        said = [r.getMessage() for r in caplog.records if "not the one computed" in r.getMessage()]
        assert runtime.preparations.stats().heads_missed == len(said) == int(edited), said
        if edited:
            assert record.computed_tokens > words + 8, record
            assert "message 0 block 1, char " in said[0], said
            assert "Summary:\\n" in said[0] and "Summary (edited):\\n" in said[0], said
        else:
            assert record.computed_tokens <= words + 8, record  # its words and the reply's opening
            assert record.prompt_tokens > 20 * words


async def test_after_two_replies_without_summary_the_conversation_goes_on_from_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Neither the prepared compaction's reply nor its retry's has a summary, and they differ
    (as in the capture ``retry_twice_differs``): the conversation computed in idle time is the
    one Claude Code sends, the one whose summary is the first reply, so the turn after computes
    only its words."""
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", "<home>/.claude")
    ex = exchanges("retry_twice_differs")
    first, second = (ex[i]["answer"]["message"]["content"][0]["text"] for i in (2, 3))
    assert first != second

    def answer(body: dict[str, Any]) -> str:
        last = str(body["messages"][-1].get("content"))
        if not last.startswith(FIRST_LINE):
            return "beta"
        return second if last.endswith(RETRY_PARAGRAPH) else first

    the_turn = copy.deepcopy(ex[1]["body"])
    prompt = len(tokenize(render(MessagesTranslator().translate(the_turn).body)))
    fake = FakeLlama(script=[answer] * 20)
    async with running(fake, ctx_per_slot=prompt + 4096 + 13000) as runtime:
        await (await send(runtime, the_turn)).message()
        await wait_for(lambda: runtime.preparations.stats().heads == 1)
        await wait_for(lambda: len(runtime.records()) == 4 and not runtime.running())
        for index in (2, 3):
            served = await send(runtime, copy.deepcopy(ex[index]["body"]))
            assert served.done
        before = fake.computed
        await (await send(runtime, copy.deepcopy(ex[4]["body"]))).message()
        record = runtime.records()[-1]
        assert fake.computed - before == record.computed_tokens
        assert record.computed_tokens <= len(tokenize("Reply with the single word: gamma")) + 8
        stats = runtime.preparations.stats()
        assert (stats.prepared, stats.served, sum(stats.missed.values())) == (2, 2, 0)


# -- the bounds, with stand-in exchanges ------------------------------------------------------


@attrs.define(eq=False)
class _Record:
    output_tokens: int = 0
    generated: int = 0


@attrs.define(eq=False)
class _Stub:
    """An exchange as Preparations sees it."""

    prepared: Prepared
    record: _Record = attrs.field(factory=_Record)
    done: bool = False
    joinable: bool = True
    gave_way: bool = False
    emitted: tuple[Any, ...] = ()
    cancelled: bool = False
    claimed: int | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def claim(self, priority: int) -> None:
        self.claimed = priority


def _preparations(now: list[float], **kwargs: Any) -> Preparations[_Stub]:
    async def prepare(body: Any, agent: str, priority: int) -> Prepared:
        return Prepared(agent=agent, priority=priority, engine=None, tokens=(), key=body["key"])  # type: ignore[arg-type]

    return Preparations(
        prepare=prepare,
        start=lambda prepared: _Stub(prepared),
        later=lambda *args: True,
        window=32768,
        clock=lambda: now[0],
        **kwargs,
    )


async def _queue(preparations: Preparations[_Stub], agent: str, key: str) -> _Stub:
    token = object()
    preparations._pending[agent] = token
    await preparations._prepare(agent, {"key": key}, token, "compaction request", None)
    (stub,) = (s for s in preparations.running() if s.prepared.agent == agent)
    return stub


def _request(agent: str, key: str) -> Prepared:
    return Prepared(agent=agent, priority=1, engine=None, tokens=(), key=key)  # type: ignore[arg-type]


async def test_a_prepared_reply_waits_a_bounded_time_one_per_agent() -> None:
    now = [0.0]
    preparations = _preparations(now, wait=60.0, max_waiting=2)
    first = await _queue(preparations, "a", "k1")
    newer = await _queue(preparations, "a", "k2")  # one per agent: the older one goes
    assert first.cancelled and preparations.stats().missed["replaced"] == 1
    await _queue(preparations, "b", "k3")
    oldest_b = preparations.running()[-1]
    await _queue(preparations, "c", "k4")  # at most two agents: the oldest ("a") goes
    assert newer.cancelled and preparations.stats().missed["expired"] == 1
    assert preparations.stats().waiting == 2
    now[0] = 61.0  # past the wait: every one goes
    assert preparations.stats().waiting == 0
    assert oldest_b.cancelled and preparations.stats().missed["expired"] == 3
    # a stopped one's tokens count when it ends
    oldest_b.record.generated = 7
    oldest_b.done = True
    preparations.ended(oldest_b, ok=False, running=True)  # type: ignore[arg-type]
    assert preparations.stats().wasted_tokens == 7
    assert preparations.claim(_request("c", "k4")) is None  # gone


async def test_the_agents_next_request_decides() -> None:
    now = [0.0]
    preparations = _preparations(now)
    stub = await _queue(preparations, "a", "k1")
    assert preparations.claim(_request("b", "k1")) is None  # another agent's: nothing
    assert preparations.claim(_request("a", "k1")) is stub and stub.claimed == 1
    assert preparations.stats().joined == 1  # it was still running
    stub = await _queue(preparations, "a", "k2")
    assert preparations.claim(_request("a", "other"), retry=True) is None  # a retry joins its own
    assert not stub.cancelled
    assert preparations.claim(_request("a", "other")) is None
    assert stub.cancelled and preparations.stats().missed["not_compaction"] == 1
