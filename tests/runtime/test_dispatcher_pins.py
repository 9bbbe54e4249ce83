"""The store entry a lease was placed to restore stays until the lease ends."""

from __future__ import annotations

import pytest

from agentkv._types import Source
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.store import EntryKind, StoreEntry, StoreIndex, entry_id

pytestmark = pytest.mark.anyio

HEAD = tuple(range(1000, 9000))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stored(tokens: tuple[int, ...]) -> StoreEntry:
    return StoreEntry(
        id=entry_id(EntryKind.PREFIX, tokens),
        kind=EntryKind.PREFIX,
        tokens=tokens,
        nbytes=len(tokens) * 12_300,
        created=0,
        last_used=0,
    )


async def test_a_save_elsewhere_does_not_supersede_the_entry_a_lease_is_about_to_restore() -> None:
    """Between placement and restore, another slot saves a longer context that starts with the
    placed entry: without the pin the index drops the entry and the restore finds nothing."""
    store = StoreIndex(budget=10**12)
    head = stored(HEAD)
    store.add(head, 0)
    dispatcher = Dispatcher(RuntimeConfig(n_slots=2), store_index=lambda: store, clock=lambda: 1.0)
    ticket = dispatcher.submit("fresh", 1, (*HEAD, 1, 2, 3))
    lease = await dispatcher.wait(ticket)
    assert lease.placement.source is Source.STORE
    assert lease.placement.entry_id == head.id
    longer = stored((*HEAD, 7, 7, 7))  # another agent's context parked meanwhile
    assert head not in store.add(longer, 2)
    assert store.get(head.id) is not None
    dispatcher.release(lease, holds=ticket.tokens)
    assert not store.pinned(head.id)  # the lease is over: the next save may supersede it
    assert head in store.add(stored((*HEAD, 7, 7, 7, 8)), 3)


async def test_a_lease_placed_without_the_store_pins_nothing() -> None:
    store = StoreIndex(budget=10**12)
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1), store_index=lambda: store, clock=lambda: 1.0)
    ticket = dispatcher.submit("cold", 1, (1, 2, 3))
    lease = await dispatcher.wait(ticket)
    assert lease.placement.source is Source.NONE
    assert not any(store.pinned(entry.id) for entry in store.entries())
    dispatcher.release(lease, holds=ticket.tokens)
