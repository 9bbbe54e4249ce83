"""A pool of engines under one runtime, against fake engines: routing, moving a context from one
engine to another, an engine lost and rejoining."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest

from agentkv.exceptions import EngineError, EngineUnavailableError
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.seam import Engine
from agentkv.runtime.store import PrefixStore
from agentkv.store import EntryKind, StoreIndex
from tests.fakes import FakeLlama, render, tokenize, wait_for

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful coding agent working in a large repository. " * 120


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.define
class Killable:
    """A fake engine's transport that can be made to refuse every connection (a dead engine)."""

    fake: FakeLlama
    dead: bool = False
    #: The engine hangs: it accepts connections and never answers.
    hung: bool = False

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if self.hung:
            await anyio.sleep_forever()
        response = await self.fake.handle(request)
        if response.headers.get("content-type") != "text/event-stream":
            return response

        async def cut(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            async for chunk in chunks:
                if self.dead:  # the engine died mid-stream: the connection breaks
                    raise httpx.ReadError("connection reset by peer", request=request)
                yield chunk

        return httpx.Response(200, headers=response.headers, content=cut(response.aiter_raw()))


def member(name: str, transport: Killable) -> LlamaSlotClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(transport.handle))
    return LlamaSlotClient(f"http://{name}", http=http, connect_retries=0)


def pool_of(
    fakes: list[FakeLlama], tmp_path: Path, *, slots: int = 2, **settings: Any
) -> tuple[EnginePool, list[Killable]]:
    transports = [Killable(fake) for fake in fakes]
    dirs = []
    for i, fake in enumerate(fakes):
        fake.save_dir = tmp_path / f"engine-{i}"
        fake.save_dir.mkdir(parents=True, exist_ok=True)
        dirs.append(fake.save_dir)
    store_dir = tmp_path / "store"
    store_dir.mkdir(exist_ok=True)
    pool = EnginePool(
        [member(f"engine{i}", t) for i, t in enumerate(transports)],
        slots=[slots] * len(fakes),
        slot_dirs=dirs,
        store_dir=store_dir,
        **settings,
    )
    return pool, transports


def chat(words: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words}]}


def request(words: str, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": max_tokens,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": words}],
    }


async def ask(runtime: Runtime, body: dict[str, Any], agent: str) -> dict[str, Any]:
    prepared = await runtime.prepare(body, agent=agent, priority=1)
    return await runtime.submit(prepared).message()


@asynccontextmanager
async def running(pool: EnginePool, tmp_path: Path, **config: Any) -> AsyncIterator[Runtime]:
    settings = {"n_slots": pool.n_slots, "store_dir": tmp_path / "store", **config}
    async with pool, Runtime(pool, RuntimeConfig(**settings)) as runtime:
        yield runtime


async def test_each_call_goes_to_the_engine_that_owns_the_slot(tmp_path: Path) -> None:
    """Global slot k is (engine, local slot): slots 0-1 are engine 0's, 2-3 engine 1's; calls
    naming no slot go to the first engine."""
    a, b = FakeLlama(reply="from a"), FakeLlama(reply="from b")
    pool, _ = pool_of([a, b], tmp_path)
    async with pool:
        assert pool.n_slots == 4
        reply = await pool.chat(chat("hi"), slot=3)
        assert reply["choices"][0]["message"]["content"] == "from b"
        assert [r["id_slot"] for r in b.requests] == [1] and a.requests == []
        async with pool.stream(chat("hi"), slot=1) as chunks:
            assert [c async for c in chunks]
        assert a.requests[-1]["id_slot"] == 1
        async with pool.prefill([1, 2, 3], slot=2) as chunks:
            assert [c async for c in chunks]
        assert b.requests[-1]["id_slot"] == 0 and b.requests[-1]["prompt"] == [1, 2, 3]
        await pool.erase_slot(2)
        assert b.slot_actions[-1] == (0, "erase", "")
        tokens = await pool.prompt_tokens(chat("hi"))
        assert tokens == tokenize(render(chat("hi")))
        assert "/apply-template" in a.paths and "/apply-template" not in b.paths
        ids = [row["id"] for row in await pool.slots()]
        assert ids[:2] == [0, 1] and 2 in ids  # renumbered into the pool's slots
        with pytest.raises(ValueError, match="no slot 4"):
            pool.member_of(4)


async def test_a_context_saved_on_one_engine_is_restored_on_another(tmp_path: Path) -> None:
    """Save on engine 0 puts the file into the store's directory; a restore on engine 1 links it
    into engine 1's directory, restores it (checked as any restore) and removes the link."""
    a, b = FakeLlama(), FakeLlama()
    pool, _ = pool_of([a, b], tmp_path)
    store = PrefixStore(tmp_path / "store", pool, StoreIndex(budget=1 << 30))
    async with pool:
        await store.open()
        async with pool.prefill(list(range(1, 500)), slot=0) as chunks:
            assert [c async for c in chunks]
        entry = await store.save(0, EntryKind.CONTEXT, agent="x")
        assert entry is not None and entry.n_tokens == 499
        assert (tmp_path / "store" / f"{entry.id}.bin").exists()
        assert list((tmp_path / "engine-0").glob("*.bin")) == []
        reply = await store.restore(entry, 3)
        assert reply is not None and reply["n_restored"] == 499
        assert b.cache[1] == list(range(1, 500))  # engine 1, its slot 1
        assert list((tmp_path / "engine-1").glob("*.bin")) == []
        # Two slots of one engine restoring one entry at once each get their own staged file.
        async with anyio.create_task_group() as tg:
            for slot in (2, 3):
                tg.start_soon(store.restore, entry, slot)
        assert b.cache[0] == b.cache[1] == list(range(1, 500))
        staged = [name for _, action, name in b.slot_actions if action == "restore"]
        assert len(set(staged[-2:])) == 2 and entry.id not in staged[-1]
        assert list((tmp_path / "engine-1").glob("*.bin")) == []
        # A store file that cannot be staged is a failed link: the store keeps the entry.
        with pytest.raises(EngineUnavailableError, match="copy a slot file"):
            await pool.restore_slot(2, "akv-missing.bin")
        # A file that does not hold what the index says is never restored, on any engine.
        (tmp_path / "store" / f"{entry.id}.bin").write_bytes(b"garbage")
        sent = len(b.slot_actions)
        assert await store.restore(entry, 2) is None
        assert b.slot_actions[sent:] == []  # refused before it reached the engine
        assert entry.id not in store.index


async def test_four_agents_on_two_engines_compute_the_shared_head_once(tmp_path: Path) -> None:
    """Four agents with one long head on two engines of one slot each: both engines serve, and
    the head is computed once across the pool (the other engine restores it from the store)."""
    a, b = FakeLlama(reply="ok", prefill_delay=0.2), FakeLlama(reply="ok", prefill_delay=0.2)
    pool, _ = pool_of([a, b], tmp_path, slots=1)
    async with running(pool, tmp_path, ctx_per_slot=32768) as runtime:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(ask, runtime, request(f"Agent {i}: reply with ok"), f"agent{i}")
        records = runtime.records()
        assert len(records) == 4 and all(r.status == "ok" for r in records)
        assert {r.slot for r in records} == {0, 1}  # both engines served
        head = max(r.checkpoint_tokens or 0 for r in records)
        assert head > 1000
        prompt = max(r.prompt_tokens for r in records)
        assert a.computed + b.computed < head + 4 * (prompt - head) + 8
        assert a.computed > 0 and b.computed > 0


async def test_an_engine_that_dies_leaves_placement_and_rejoins_empty(tmp_path: Path) -> None:
    """An engine that stops answering is taken out: its slots are out, the next requests run on
    the other engine; the request running on it gets the usual error. When it answers again its
    slots come back, empty."""
    a, b = FakeLlama(reply="ok"), FakeLlama(reply="ok", prefill_delay=2.0)
    pool, (_, dying) = pool_of([a, b], tmp_path, slots=1, health_interval=0.05)
    async with running(pool, tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, request("first on engine 0"), "x")
        # Engine 0's slot is busy: the next request goes to engine 1, which dies under it.
        async with anyio.create_task_group() as tg:
            a.prefill_delay = 0.5
            tg.start_soon(ask, runtime, request("busy on engine 0"), "x")
            await wait_for(lambda: runtime.dispatcher.slots.free == 1)
            exchange = runtime.submit(
                await runtime.prepare(request("on engine 1"), agent="y", priority=1)
            )
            await wait_for(lambda: b.started == 1)
            dying.dead = True
            with pytest.raises(EngineError):
                await exchange.message()
        assert exchange.record.slot == 1
        await wait_for(lambda: not pool.members[1].up)
        assert runtime.dispatcher.slots.is_out(1)
        snapshot = runtime.snapshot()
        assert [row.state for row in snapshot.slots] == ["idle", "out"]
        assert snapshot.engines is not None and snapshot.engines[1].up is False
        # Everything goes on on engine 0, one after the other.
        a.prefill_delay = 0.0
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(ask, runtime, request(f"agent {i}"), f"agent{i}")
        recent = runtime.records()[-3:]
        assert [r.status for r in recent] == ["ok"] * 3 and {r.slot for r in recent} == {0}
        # Engine 1 comes back: it rejoins, its slot empty, and serves again.
        dying.dead = False
        await wait_for(lambda: pool.members[1].up)
        assert not runtime.dispatcher.slots.is_out(1)
        assert runtime.dispatcher.slots.table()[1].tokens == ()
        assert pool.members[1].rejoined == 1
        b.prefill_delay = 0.0
        a.prefill_delay = 0.5
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(ask, runtime, request(f"again {i}"), f"again{i}")
        assert {r.slot for r in runtime.records()[-2:]} == {0, 1}


async def test_calls_naming_no_slot_go_on_when_the_first_engine_is_down(tmp_path: Path) -> None:
    """Templating and tokenizing fail over to an engine that is up; a call failing on an engine
    makes the pool probe it at once."""
    a, b = FakeLlama(), FakeLlama()
    pool, (dead, _) = pool_of([a, b], tmp_path, health_interval=30.0, health_failures=1)
    changes: list[tuple[range, bool]] = []
    async with pool, anyio.create_task_group() as tg:
        tg.start_soon(pool.watch, lambda slots, up: changes.append((slots, up)))
        dead.dead = True
        assert await pool.prompt_tokens(chat("hi")) == tokenize(render(chat("hi")))
        assert "/apply-template" in b.paths
        # The failed call woke the watcher long before its 30 s interval.
        await wait_for(lambda: changes == [(range(0, 2), False)], timeout=2.0)
        state, detail = await pool.engine_state()
        assert state == "ready" and detail == "1 of 2 engines ready"
        with pytest.raises(EngineUnavailableError, match="unavailable"):
            await pool.chat(chat("hi"), slot=0)  # fails at once: the engine is known down
        tg.cancel_scope.cancel()


async def test_a_restarted_engine_rejoins_with_its_slots_empty(tmp_path: Path) -> None:
    """A launched engine's supervisor restarting it between two probes: its slots are
    forgotten (a new generation), while the other engine's are kept."""
    from agentkv.runtime.status import EngineStatus

    a, b = FakeLlama(), FakeLlama()
    transports = [Killable(a), Killable(b)]
    clients = [member(f"e{i}", t) for i, t in enumerate(transports)]
    status = EngineStatus()
    clients[1].status = status
    pool = EnginePool(clients, slots=[1, 1], health_interval=0.05)
    changes: list[tuple[range, bool]] = []
    async with pool, anyio.create_task_group() as tg:
        tg.start_soon(pool.watch, lambda slots, up: changes.append((slots, up)))
        status.set_state("restarting", "it died")
        await wait_for(lambda: changes == [(range(1, 2), False)])
        status.new_generation()
        await wait_for(lambda: changes[-1] == (range(1, 2), True))
        assert pool.members[1].rejoined == 1 and pool.members[0].up
        tg.cancel_scope.cancel()


async def test_an_engine_that_stops_answering_is_down(tmp_path: Path) -> None:
    """A hung engine (its /health never answers) is down after ``health_failures`` probes of
    ``health_timeout`` seconds; it rejoins when it answers again."""
    a, b = FakeLlama(), FakeLlama()
    pool, (hung, _) = pool_of(
        [a, b], tmp_path, health_interval=0.05, health_timeout=0.1, health_failures=2
    )
    changes: list[tuple[range, bool]] = []
    async with pool, anyio.create_task_group() as tg:
        tg.start_soon(pool.watch, lambda slots, up: changes.append((slots, up)))
        await anyio.sleep(0.3)
        assert changes == []  # both answer: nothing changes
        hung.hung = True
        await wait_for(lambda: changes == [(range(0, 2), False)])
        assert pool.members[0].failures >= 2 and "does not answer" in pool.members[0].detail
        hung.hung = False
        await wait_for(lambda: changes[-1] == (range(0, 2), True))
        tg.cancel_scope.cancel()


def test_a_pool_needs_its_shape() -> None:
    """Slot counts and directories are given for every engine."""
    clients = [LlamaSlotClient("http://a"), LlamaSlotClient("http://b")]
    with pytest.raises(ValueError, match="slot count"):
        EnginePool(clients, slots=[1])
    with pytest.raises(ValueError, match="no slots"):
        EnginePool(clients, slots=[1, 0])
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([], slots=[])


def test_every_engine_call_of_the_client_is_routed() -> None:
    """Each call of the engine seam is the pool's own, so a call added to the seam later cannot
    reach a member's client unrouted; the pool holds its clients, it is not one."""
    seam = {name for name in vars(Engine) if not name.startswith("_")}
    assert seam
    missing = sorted(name for name in seam if name not in vars(EnginePool))
    assert not missing, missing
    assert not issubclass(EnginePool, LlamaSlotClient)
