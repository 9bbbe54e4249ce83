"""Ownership of the slot table, and of each engine client's link, by construction.

The dispatcher (:class:`~agentkv.runtime.dispatcher.Dispatcher`) creates the table and alone writes
who holds a slot; it hands the writer of what slots hold (:class:`~agentkv.slots.ContentWriter`) to
one owner, the runtime's :class:`~agentkv.runtime.contents.SlotContents`, and to everyone else the
read-only :class:`~agentkv.slots.SlotReader`. ``mypy --strict`` (CI) then refuses a write through
a reader. What the types cannot say is checked here: the content writer has one holder, and each
face covers what the table offers.
"""

from __future__ import annotations

import inspect

import attrs
import pytest

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.slots import ContentWriter, SlotManager, SlotReader

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
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1))
    dispatcher.hand_contents()
    with pytest.raises(RuntimeError, match="already have their owner"):
        dispatcher.hand_contents()


def test_every_table_method_belongs_to_one_face() -> None:
    """A new SlotManager method must be placed in a face (reader, content or lease writer)."""
    fields = {field.name for field in attrs.fields(SlotManager)} - {"n_slots"}
    public = {name for name in dir(SlotManager) if not name.startswith("_")} - fields
    readers = _members(SlotReader)
    contents = _members(ContentWriter)
    assert not readers & contents and not readers & LEASE_WRITERS
    assert public == readers | contents | LEASE_WRITERS


@pytest.mark.anyio
async def test_the_runtime_wires_the_content_writer_to_its_cache() -> None:
    """In a runtime, the content writer is the SlotContents's: nobody can take it afterwards."""
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.lifecycle import Runtime

    async with LlamaSlotClient("http://127.0.0.1:9") as client:
        runtime = Runtime(client, RuntimeConfig(n_slots=2))
        assert runtime.contents.slots.table() == runtime.dispatcher.slots.table()
        with pytest.raises(RuntimeError):
            runtime.dispatcher.hand_contents()


@pytest.mark.anyio
async def test_each_engine_client_holds_its_link_alone() -> None:
    """An engine client answers for its link from the link it holds (nothing of it is copied
    onto the client), and a supervisor's status given later is the supervisor's to move."""
    from agentkv.runtime.adapters import ADAPTERS
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.status import EngineStatus
    from agentkv.runtime.transport import LinkedEngine

    for cls in (LlamaSlotClient, *ADAPTERS.values()):
        async with cls("http://127.0.0.1:9/") as client:
            assert isinstance(client, LinkedEngine)
            assert not {"base_url", "link", "status"} & vars(client).keys()
            assert client.base_url == "http://127.0.0.1:9" and client.link.requests == 0
            assert client.set_reachable(False, "down")  # no supervisor: the link's own status
            status = EngineStatus()
            client.status = status
            assert client.status is status and not client.set_reachable(False, "down")
            assert status.state == "ready"
