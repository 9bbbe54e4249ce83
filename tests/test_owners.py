"""Ownership of the slot table, by construction.

The dispatcher (:class:`~agentkv.runtime.gateway.Gateway`) creates the table and alone writes who
holds a slot; it hands the writer of what slots hold (:class:`~agentkv.slots.SlotContents`) to one
owner, the runtime's ``KVCache``, and to everyone else the read-only
:class:`~agentkv.slots.SlotReader`. ``mypy --strict`` (CI) then refuses a write through a reader.
What the types cannot say is checked here: the content writer has one holder, and each face
covers what the table offers.
"""

from __future__ import annotations

import inspect

import attrs
import pytest

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.gateway import Gateway
from agentkv.slots import SlotContents, SlotManager, SlotReader

#: Who holds a slot: written by the dispatcher only, through the table it keeps to itself.
LEASE_WRITERS = frozenset({"acquire", "release", "sweep", "touch"})


def _members(protocol: type) -> set[str]:
    return {
        name
        for name, _ in inspect.getmembers(protocol)
        if not name.startswith("_") and name in protocol.__dict__
    }


def test_the_content_writer_has_one_owner() -> None:
    """The dispatcher hands the content writer out once; a second owner is refused."""
    gateway = Gateway(RuntimeConfig(n_slots=1))
    gateway.hand_contents()
    with pytest.raises(RuntimeError, match="already have their owner"):
        gateway.hand_contents()


def test_every_table_method_belongs_to_one_face() -> None:
    """A new SlotManager method must be placed in a face (reader, content or lease writer)."""
    fields = {field.name for field in attrs.fields(SlotManager)} - {"n_slots"}
    public = {name for name in dir(SlotManager) if not name.startswith("_")} - fields
    readers = _members(SlotReader)
    contents = _members(SlotContents)
    assert not readers & contents and not readers & LEASE_WRITERS
    assert public == readers | contents | LEASE_WRITERS


@pytest.mark.anyio
async def test_the_runtime_wires_the_content_writer_to_its_cache() -> None:
    """In a runtime, the content writer is the KVCache's: nobody can take it afterwards."""
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.lifecycle import Runtime

    async with LlamaSlotClient("http://127.0.0.1:9") as client:
        runtime = Runtime(client, RuntimeConfig(n_slots=2))
        assert runtime.kvcache.slots.table() == runtime.gateway.slots.table()
        with pytest.raises(RuntimeError):
            runtime.gateway.hand_contents()
