"""The runtime's snapshot: what ``GET /agentkv/slots`` answers, round-tripped through JSON and held
to its documentation (docs/observability.md, one line per field)."""

from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import anyio
import attrs
import pytest

from agentkv.agents import AgentView
from agentkv.runtime.record import RequestRecord
from agentkv.snapshot import (
    AgentTotals,
    BackgroundRow,
    CheckpointRow,
    CompactionRow,
    Divergence,
    EngineRow,
    PendingCompactionRow,
    QueueRow,
    RequestView,
    RuntimeSnapshot,
    StoreEntryRow,
    StoreSnapshot,
    converter,
    unstructure,
)
from agentkv.store import EntryKind
from tests._snapshot import empty_snapshot, request_view, slot_row
from tests.fakes import FakeLlama, served
from tests.server.test_subagents import post

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
SECTION = "## The snapshot: `GET /agentkv/slots`"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def documented() -> dict[str, list[str]]:
    """The documentation's fields, by class: each ``#### … (`Class` …)`` heading of the section,
    then its ``- `field`: …`` lines."""
    section = DOC.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    classes: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in section.splitlines():
        heading = re.match(r"#### .*\(`(\w+)`", line)
        if heading:
            current = classes.setdefault(heading.group(1), [])
            continue
        field = re.match(r"- `(\w+)`: ", line)
        if field and current is not None:
            current.append(field.group(1))
    return classes


def _options(tp: Any) -> tuple[Any, ...]:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def reachable(tp: Any, found: dict[str, type] | None = None) -> dict[str, type]:
    """Every attrs class a value of type ``tp`` may hold, by name."""
    found = {} if found is None else found
    if attrs.has(tp):
        if tp.__name__ not in found:
            found[tp.__name__] = tp
            for hint in get_type_hints(tp).values():
                reachable(hint, found)
        return found
    for arg in get_args(tp):
        reachable(arg, found)
    return found


def check(value: Any, tp: Any, docs: dict[str, list[str]], seen: set[str], where: str) -> None:
    """``value`` (JSON) has, at every object of type ``tp`` and below it, the documented keys in
    the documented order; ``seen`` gathers the classes met."""
    options = [t for t in _options(tp) if t is not type(None)]
    if value is None:
        assert type(None) in _options(tp), f"{where}: null where {tp} is expected"
        return
    if len(options) > 1:
        (tp,) = [t for t in options if attrs.has(t) and docs[t.__name__] == list(value)]
    else:
        (tp,) = options
    origin = get_origin(tp)
    if attrs.has(tp):
        assert isinstance(value, dict), where
        assert list(value) == docs[tp.__name__], f"{where}: keys of {tp.__name__}"
        seen.add(tp.__name__)
        for name, hint in get_type_hints(tp).items():
            check(value[name], hint, docs, seen, f"{where}.{name}")
    elif origin is tuple:
        assert isinstance(value, list), where
        args = get_args(tp)
        items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        assert len(items) == len(value), where
        for i, (item, hint) in enumerate(zip(value, items, strict=True)):
            check(item, hint, docs, seen, f"{where}[{i}]")
    elif origin is Mapping or origin is dict:
        assert isinstance(value, dict), where
        for key, item in value.items():
            check(item, get_args(tp)[1], docs, seen, f"{where}[{key!r}]")


def full_snapshot() -> RuntimeSnapshot:
    """A snapshot with a value in every optional place and a row of every kind."""
    divergence = Divergence(
        reused=812, computed=90, seconds=1.5, position=812, section="message 3", candidate="slot 0"
    )
    return empty_snapshot(
        slots=(
            slot_row(
                0, agent="s", tokens=900, busy=True, state="decoding", priority=1, leases=(4,)
            ),
            slot_row(1, agent="s/a1", stored="akv-context-1", idle_s=2.5, parent="s", tokens=80),
            slot_row(2, state="out"),
        ),
        queue=(QueueRow(7, "t", 1, 1200, 0.75, 0.25, 3, "s", "write the tests"),),
        background=(BackgroundRow(8, "s", 0.5),),
        checkpoints=(CheckpointRow(3, "s", 0, 1024, 512, 0.25),),
        store=StoreSnapshot(
            directory_entries=1,
            bytes=4096,
            budget=1 << 30,
            saves=2,
            restores=1,
            tokens_restored=80,
            seconds_saved=0.5,
            save_seconds=0.01,
            restore_seconds=0.02,
            evicted=1,
            expired=0,
            refused=0,
            entries=(
                StoreEntryRow("akv-context-1", EntryKind.CONTEXT, "s/a1", 80, 4096, 1, 2.5, 3.5),
            ),
        ),
        compactions=(CompactionRow("s", 6, 9000, 1200, 7800, 640), PendingCompactionRow("t", True)),
        engines=(
            EngineRow(0, "http://a", (0, 1), True, "", 0),
            EngineRow(1, "http://b", (2, 2), False, "refused", 1),
        ),
        agents={"s": AgentTotals(3, 2700, 1600, 1), "s/a1": AgentTotals(1, 80, 0, 1)},
        tree=(
            AgentView("s", "s", None, 0, 1, None, None, None, False, 1, 3, 0.5),
            AgentView(
                "s/a1", "s", "s", 1, 1, "write the tests", "general-purpose", False, True, 0, 1, 2.5
            ),
        ),
        running=(
            request_view("s", status="running", prefilled=None, generating_s=0.5, generated=9),
        ),
        recent=(
            request_view("s/a1", parent="s", description="write the tests", waited_on=True),
            request_view(
                "s", divergence=divergence, status="error: api_error", error_type="api_error"
            ),
        ),
    )


def test_every_class_of_the_snapshot_is_documented_field_by_field() -> None:
    """The documentation lists each class of the snapshot, and each one's fields in order."""
    docs = documented()
    classes = reachable(RuntimeSnapshot)
    assert set(docs) == set(classes)
    for name, cls in classes.items():
        assert docs[name] == [f.name for f in attrs.fields(cls)], name


def test_a_request_is_shown_with_every_field_of_its_record() -> None:
    assert [f.name for f in attrs.fields(RequestView)] == [
        f.name for f in attrs.fields(RequestRecord)
    ]


def test_a_full_snapshot_round_trips_through_json_with_the_documented_keys() -> None:
    snapshot = full_snapshot()
    data = json.loads(json.dumps(unstructure(snapshot)))
    assert converter.structure(data, RuntimeSnapshot) == snapshot
    seen: set[str] = set()
    check(data, RuntimeSnapshot, documented(), seen, "snapshot")
    assert seen == set(reachable(RuntimeSnapshot))  # every kind of row was checked


async def test_the_slot_table_is_the_snapshot_with_exactly_the_documented_keys(
    tmp_path: Path,
) -> None:
    """A runtime with a store, a fan-out of sub-agents and a parked context: its snapshot
    round-trips through JSON, and ``GET /agentkv/slots`` answers JSON with the documented keys."""
    fake = FakeLlama(reply="done", save_dir=tmp_path)
    async with served(fake, store_dir=tmp_path, n_slots=2, park_min=8) as http:
        await post(http, "fg_1_coordinator.json")
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, http, "fg_2_subagent_back.json")
            tg.start_soon(post, http, "fg_3_subagent_front.json")
        await post(http, "fg_4_continuation.json")
        snapshot = http.runtime.snapshot()  # type: ignore[attr-defined]
        response = await http.get("/agentkv/slots")
    data = json.loads(json.dumps(unstructure(snapshot)))
    assert converter.structure(data, RuntimeSnapshot) == snapshot
    assert response.status_code == 200
    body = response.json()
    seen: set[str] = set()
    check(body, RuntimeSnapshot, documented(), seen, "snapshot")
    met = {"RuntimeSnapshot", "SlotRow", "Placements", "StoreSnapshot", "StoreEntryRow"}
    met |= {"AgentTotals", "AgentView", "RequestView", "Divergence", "CostsView"}
    assert met <= seen, met - seen
    served_tree = converter.structure(body, RuntimeSnapshot).tree
    assert [row.agent for row in served_tree] == [row.agent for row in snapshot.tree]
    assert len(snapshot.tree) == 3
