"""Two requests with a few prompt tokens each go one after the other, not in one engine batch:
the first gets its first token sooner, the second no later (prefill is priced per token)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from agentkv._types import Ticket
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.store import EntryKind, StoreEntry, StoreIndex, entry_id

pytestmark = pytest.mark.anyio

HEAD = tuple(range(1000, 9000))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stored(tokens: tuple[int, ...], agent: str) -> StoreEntry:
    return StoreEntry(
        id=entry_id(EntryKind.CONTEXT, tokens),
        kind=EntryKind.CONTEXT,
        tokens=tokens,
        nbytes=len(tokens) * 12_300,
        created=0,
        last_used=0,
        agent=agent,
    )


def restarted() -> Dispatcher:
    """After a restart: two agents' contexts in the store, both slots empty."""
    store = StoreIndex(budget=10**12)
    store.add(stored((*HEAD, 1, 1), "a"), 0)
    store.add(stored((*HEAD, 2, 2), "b"), 0)
    return Dispatcher(RuntimeConfig(n_slots=2), store_index=lambda: store, clock=lambda: 1.0)


async def dispatched(dispatcher: Dispatcher, ticket: Ticket) -> bool:
    """Whether ``ticket`` has its lease (it is no longer in the queue)."""
    await anyio.lowlevel.checkpoint()
    return ticket.id not in {row.ticket for row in dispatcher.snapshot().queue}


async def test_a_short_prefill_waits_for_the_first_token_of_another_short_one() -> None:
    dispatcher = restarted()
    first = dispatcher.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    second = dispatcher.submit("b", 1, (*HEAD, 2, 2, *range(30)))
    lease = await dispatcher.wait(first)
    dispatcher.declare_running(lease, 1)
    assert not await dispatched(dispatcher, second)  # a slot is free, but it would share a batch
    dispatcher.note_decoding(lease)  # the first one's first token
    other = await dispatcher.wait(second)
    assert other.slot != lease.slot


async def test_a_long_prefill_elsewhere_or_a_more_urgent_ticket_does_not_wait() -> None:
    dispatcher = restarted()
    long = dispatcher.submit("c", 1, tuple(range(50_000, 52_000)))  # 2,000 tokens to compute
    lease = await dispatcher.wait(long)
    dispatcher.declare_running(lease, 1)
    short = dispatcher.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    assert await dispatched(dispatcher, short)  # shares the long prefill batch by batch
    dispatcher.release(lease, holds=long.tokens)

    dispatcher = restarted()
    background = dispatcher.submit("a", 2, (*HEAD, 1, 1, *range(20)))
    lease = await dispatcher.wait(background)
    dispatcher.declare_running(lease, 2)
    urgent = dispatcher.submit("b", 0, (*HEAD, 2, 2, *range(30)))
    assert await dispatched(dispatcher, urgent)
    # A request that computes more than one batch itself never waits either.
    dispatcher = restarted()
    lease = await dispatcher.wait(dispatcher.submit("a", 1, (*HEAD, 1, 1, *range(20))))
    dispatcher.declare_running(lease, 1)
    assert await dispatched(dispatcher, dispatcher.submit("d", 1, tuple(range(60_000, 61_000))))


async def test_a_release_without_a_first_token_lets_the_held_ticket_go() -> None:
    dispatcher = restarted()
    first = dispatcher.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    second = dispatcher.submit("b", 1, (*HEAD, 2, 2, *range(30)))
    lease = await dispatcher.wait(first)
    dispatcher.declare_running(lease, 1)
    assert not await dispatched(dispatcher, second)
    dispatcher.release(lease, holds=None)  # it failed before decoding
    assert await dispatched(dispatcher, second)


async def test_a_ticket_held_for_a_first_token_is_not_overtaken() -> None:
    """While the short request whose turn it is waits for another's first token, a later request
    with a long prompt does not take the free slot: the queue's order (and with it the
    starvation bound) holds, and the short one goes first."""
    dispatcher = restarted()
    first = dispatcher.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    lease = await dispatcher.wait(first)
    dispatcher.declare_running(lease, 1)
    short = dispatcher.submit("b", 1, (*HEAD, 2, 2, *range(30)))
    long = dispatcher.submit("c", 1, tuple(range(50_000, 51_000)))
    assert not await dispatched(dispatcher, short)
    assert not await dispatched(dispatcher, long)  # the free slot waits for the short one
    dispatcher.note_decoding(lease)
    await dispatcher.wait(short)
    assert not await dispatched(dispatcher, long)  # both slots are held now
