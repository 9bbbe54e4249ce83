"""The replayable event log: late followers, keep-alives, the end, and orphans."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from agentkv.exceptions import EngineUnavailableError
from agentkv.reply import BlockClosed, BlockOpened, Ended, Started, Usage
from agentkv.runtime.broadcast import Broadcast, Emitted, Event, Failed, KeepAlive

START = Started("msg_1", "m", 1)
OPENED = BlockOpened(0, "text")

pytestmark = pytest.mark.anyio


def _log(
    abandoned: list[bool],
    *,
    grace: float = 0.05,
    ping_interval: float = 5.0,
    spawn: Callable[[Callable[[], Awaitable[None]]], bool] | None = None,
    clock: Callable[[], float] = lambda: 0.0,
) -> Broadcast:
    log = Broadcast(
        abandon=lambda: abandoned.append(True),
        grace=grace,
        ping_interval=ping_interval,
        clock=clock,
    )
    if spawn is not None:
        log.spawn = spawn
    return log


async def _all(log: Broadcast) -> list[Event]:
    return [item async for item in log.follow()]


async def test_a_late_follower_gets_everything_then_the_end() -> None:
    """Events emitted before a follower came are replayed to it; a failure ends every follower."""
    log = _log([])
    log.emit([START])
    log.emit([])  # nothing: no wake-up, no empty batch
    failure = EngineUnavailableError("gone")
    got: list[list[Event]] = []

    async def follow() -> None:
        got.append(await _all(log))

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        tg.start_soon(follow)
        await anyio.sleep(0.01)
        log.emit([OPENED])
        await anyio.sleep(0.01)
        log.close(failure)
        log.emit([BlockClosed(0)])  # after the end: dropped
    for items in got:
        events = [e for item in items if isinstance(item, Emitted) for e in item.events]
        assert events == [START, OPENED]
        assert items[-1] == Failed(failure)
    assert log.delivered and log.followers == 0
    assert log.emitted == (START, OPENED)
    # A follower that comes after the end still gets it all.
    late = await _all(log)
    assert late[0] == Emitted([START, OPENED])


async def test_silence_gives_keep_alives() -> None:
    log = _log([], ping_interval=0.02)
    items: list[Event] = []
    with anyio.move_on_after(0.09):
        async for item in log.follow():
            items.append(item)
    assert items and all(isinstance(item, KeepAlive) for item in items)


async def test_an_orphaned_log_abandons_its_producer_after_the_grace() -> None:
    """The last follower leaving starts the grace; nobody back in time → abandon, once."""
    abandoned: list[bool] = []
    async with anyio.create_task_group() as tg:

        def spawn(work: Callable[[], Awaitable[None]]) -> bool:
            tg.start_soon(work)
            return True

        log = _log(abandoned, spawn=spawn, clock=lambda: 42.0)
        with anyio.move_on_after(0.01):
            await _all(log)
        assert log.orphaned_at == 42.0
        assert log.unclaimed and not abandoned  # within the grace: a retry could take it over
        await anyio.sleep(0.1)
    assert abandoned == [True]


async def test_a_follower_back_within_the_grace_keeps_the_producer() -> None:
    abandoned: list[bool] = []
    async with anyio.create_task_group() as tg:

        def spawn(work: Callable[[], Awaitable[None]]) -> bool:
            tg.start_soon(work)
            return True

        log = _log(abandoned, spawn=spawn, grace=0.05)
        with anyio.move_on_after(0.01):
            await _all(log)
        tg.start_soon(_all, log)  # the client's retry joins
        await anyio.sleep(0.1)
        assert log.orphaned_at is None
        log.close()
    assert abandoned == []


async def test_without_background_an_orphan_abandons_at_once() -> None:
    """When the grace cannot run (the runtime is stopping), the producer is stopped now."""
    abandoned: list[bool] = []
    log = _log(abandoned)  # the default spawn refuses
    with anyio.move_on_after(0.01):
        await _all(log)
    assert abandoned == [True]


async def test_message_accumulates_or_raises() -> None:
    log = _log([])
    log.emit([Started("msg_1", "m", 1), Ended("end_turn", None, Usage(input_tokens=1))])
    log.close()
    assert (await log.message())["id"] == "msg_1"
    failed = _log([])
    failed.close(EngineUnavailableError("gone"))
    with pytest.raises(EngineUnavailableError):
        await failed.message()
