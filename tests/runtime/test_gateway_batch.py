"""Two requests with a few prompt tokens each go one after the other, not in one engine batch:
the first gets its first token sooner, the second no later (prefill is priced per token)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from agentkv._types import Ticket
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.gateway import Gateway
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


def restarted() -> Gateway:
    """After a restart: two agents' contexts in the store, both slots empty."""
    store = StoreIndex(budget=10**12)
    store.add(stored((*HEAD, 1, 1), "a"), 0)
    store.add(stored((*HEAD, 2, 2), "b"), 0)
    return Gateway(RuntimeConfig(n_slots=2), store_index=lambda: store, clock=lambda: 1.0)


async def dispatched(gateway: Gateway, ticket: Ticket) -> bool:
    """Whether ``ticket`` has its lease (it is no longer in the queue)."""
    await anyio.lowlevel.checkpoint()
    return ticket.id not in {row.ticket for row in gateway.snapshot().queue}


async def test_a_short_prefill_waits_for_the_first_token_of_another_short_one() -> None:
    gateway = restarted()
    first = gateway.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    second = gateway.submit("b", 1, (*HEAD, 2, 2, *range(30)))
    lease = await gateway.wait(first)
    gateway.running(lease, 1)
    assert not await dispatched(gateway, second)  # a slot is free, but it would share a batch
    gateway.decoding(lease)  # the first one's first token
    other = await gateway.wait(second)
    assert other.slot != lease.slot


async def test_a_long_prefill_elsewhere_or_a_more_urgent_ticket_does_not_wait() -> None:
    gateway = restarted()
    long = gateway.submit("c", 1, tuple(range(50_000, 52_000)))  # 2,000 tokens to compute
    lease = await gateway.wait(long)
    gateway.running(lease, 1)
    short = gateway.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    assert await dispatched(gateway, short)  # shares the long prefill batch by batch
    gateway.release(lease, holds=long.tokens)

    gateway = restarted()
    background = gateway.submit("a", 2, (*HEAD, 1, 1, *range(20)))
    lease = await gateway.wait(background)
    gateway.running(lease, 2)
    urgent = gateway.submit("b", 0, (*HEAD, 2, 2, *range(30)))
    assert await dispatched(gateway, urgent)
    # A request that computes more than one batch itself never waits either.
    gateway = restarted()
    lease = await gateway.wait(gateway.submit("a", 1, (*HEAD, 1, 1, *range(20))))
    gateway.running(lease, 1)
    assert await dispatched(gateway, gateway.submit("d", 1, tuple(range(60_000, 61_000))))


async def test_a_release_without_a_first_token_lets_the_held_ticket_go() -> None:
    gateway = restarted()
    first = gateway.submit("a", 1, (*HEAD, 1, 1, *range(20)))
    second = gateway.submit("b", 1, (*HEAD, 2, 2, *range(30)))
    lease = await gateway.wait(first)
    gateway.running(lease, 1)
    assert not await dispatched(gateway, second)
    gateway.release(lease, holds=None)  # it failed before decoding
    assert await dispatched(gateway, second)
