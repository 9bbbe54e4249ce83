"""The operator's view of a runtime, as typed data: slots, queue, store, agents and requests.

:meth:`agentkv.runtime.lifecycle.Runtime.snapshot` builds a :class:`RuntimeSnapshot`; the metrics,
the live page, ``agentkv-server status`` and the benchmarks all read it. ``GET /agentkv/slots``
answers :data:`converter`'s unstructuring of it (plain JSON), and ``status`` structures that JSON
back with the same converter, so a field added, removed or renamed on one side fails loudly on
the other. Every class is frozen; the field names are the JSON keys (documented, one line each, in
``docs/observability.md``).

Pure: attrs classes and one cattrs converter, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import attrs
import cattrs

from agentkv.agents import AgentView
from agentkv.store import EntryKind

__all__ = [
    "AgentTotals",
    "BackgroundRow",
    "CheckpointRow",
    "CompactionRow",
    "CostsView",
    "DispatcherSnapshot",
    "Divergence",
    "EngineRow",
    "PendingCompactionRow",
    "Placements",
    "QueueRow",
    "RequestView",
    "RuntimeSnapshot",
    "SlotRow",
    "SlotState",
    "SnapshotShapeError",
    "StoreEntryRow",
    "StoreSnapshot",
    "converter",
    "structure_snapshot",
    "unstructure",
]

#: What a slot is doing: ``out`` is a slot whose engine (in a pool of engines) is down.
SlotState = Literal["idle", "prefilling", "decoding", "out"]


@attrs.frozen
class SlotRow:
    """One engine slot: whose KV cache it holds and what it is doing."""

    slot: int
    agent: str | None
    #: Tokens of KV cache the slot holds.
    tokens: int
    #: The store entry that holds all of the slot's content, if any.
    stored: str | None
    busy: bool
    state: SlotState
    #: The priority of the request on it (None: none is).
    priority: int | None
    #: Seconds since it was released (None while busy, or never used).
    idle_s: float | None
    leases: tuple[int, ...]
    #: The holder's parent agent and the description of the call that started it (sub-agents).
    parent: str | None
    description: str | None


@attrs.frozen
class QueueRow:
    """A ticket waiting for a slot, in dispatch order."""

    ticket: int
    agent: str
    priority: int
    tokens: int
    waited_s: float
    score: float
    #: The checkpoint it waits for, to restore it rather than compute it.
    waiting_for_checkpoint: int | None
    parent: str | None
    description: str | None


@attrs.frozen
class BackgroundRow:
    """Background work (a compaction) waiting for an idle slot."""

    ticket: int
    agent: str
    waited_s: float


@attrs.frozen
class CheckpointRow:
    """A shared prompt head being computed on a slot, to be saved for other requests."""

    id: int
    agent: str
    slot: int
    tokens: int
    progress: int
    running_s: float


@attrs.frozen
class Placements:
    """Slots handed out since start, by where the cached part of the prompt came from."""

    acquired: int
    from_slot: int
    from_store: int
    cold: int
    reclaimed: int
    hit_rate: float
    planned_reused_tokens: int
    planned_computed_tokens: int


@attrs.frozen
class DispatcherSnapshot:
    """The dispatcher's part of the view (``Dispatcher.snapshot()``)."""

    slots: tuple[SlotRow, ...]
    queue: tuple[QueueRow, ...]
    background: tuple[BackgroundRow, ...]
    checkpoints: tuple[CheckpointRow, ...]
    placements: Placements


@attrs.frozen
class StoreEntryRow:
    """One saved slot state in the prefix store."""

    id: str
    kind: EntryKind
    agent: str | None
    tokens: int
    bytes: int
    hits: int
    idle_s: float
    value: float


@attrs.frozen
class StoreSnapshot:
    """The prefix store: its size, counters and entries (most valuable first)."""

    directory_entries: int
    bytes: int
    budget: int
    saves: int
    restores: int
    tokens_restored: int
    seconds_saved: float
    save_seconds: float
    restore_seconds: float
    evicted: int
    expired: int
    refused: int
    entries: tuple[StoreEntryRow, ...]


@attrs.frozen
class CompactionRow:
    """A compaction in force: an agent's oldest messages replaced by a summary."""

    agent: str
    messages_replaced: int
    tokens_before: int
    tokens_after: int
    saved_tokens: int
    summary_chars: int


@attrs.frozen
class PendingCompactionRow:
    """A compaction being computed for an agent."""

    agent: str
    pending: Literal[True]


@attrs.frozen
class EngineRow:
    """One engine of a pool of engines."""

    engine: int
    url: str
    #: Its first and last slot in the pool's numbering.
    slots: tuple[int, int]
    up: bool
    #: Why it is down, in words ("" while up).
    detail: str
    rejoined: int


@attrs.frozen
class AgentTotals:
    """One agent's finished requests and prompt tokens, and its last priority."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    priority: int


@attrs.frozen
class Divergence:
    """Where a prompt left the best cached candidate, and what that cost."""

    reused: int
    computed: int
    seconds: float
    position: int
    section: str | None
    candidate: str | None


@attrs.frozen
class RequestView:
    """One request, running or finished (:class:`agentkv.runtime.record.RequestRecord`)."""

    agent: str
    priority: int
    ticket: int
    parent: str | None
    description: str | None
    waited_on: bool | None
    dispatch_seq: int | None
    slot: int | None
    source: str | None
    prompt_tokens: int
    planned_reuse: int
    computed_tokens: int
    cached_tokens: int
    output_tokens: int
    draft_tokens: int
    draft_accepted: int
    decode_s: float
    checkpoint_tokens: int | None
    parked: bool
    queued_s: float
    ttft_s: float | None
    total_s: float | None
    retried: bool
    suspended: int
    stopped: str | None
    attached: int
    prefilled: int | None
    generating_s: float | None
    divergence: Divergence | None
    generated: int
    #: ``queued``, ``running``, ``suspended``, ``ok``, ``cancelled`` or ``error: <type>``.
    status: str
    error_type: str | None


@attrs.frozen
class CostsView:
    """The engine's speeds as measured from its replies (rounded)."""

    prefill_tokens_per_s_at_0: float
    prefill_tokens_per_s_at_10k: float
    decode_tokens_per_s: float
    restore_bytes_per_s: int
    bytes_per_token: int


@attrs.frozen
class RuntimeSnapshot(DispatcherSnapshot):
    """The whole operator's view: the JSON of ``GET /agentkv/slots`` (the dispatcher's fields
    first)."""

    #: None: the prefix store is off.
    store: StoreSnapshot | None
    compactions: tuple[CompactionRow | PendingCompactionRow, ...]
    #: None: one engine, not a pool.
    engines: tuple[EngineRow, ...] | None
    agents: Mapping[str, AgentTotals]
    #: The agent tree: each coordinator, then its sub-agents (empty with the tree off).
    tree: tuple[AgentView, ...]
    running: tuple[RequestView, ...]
    #: The last 16 finished requests, oldest first.
    recent: tuple[RequestView, ...]
    costs: CostsView


#: Unstructures a snapshot to JSON-ready data (tuples as lists, enums as their values) and
#: structures it back; an unknown key is an error, so a change of shape is never read silently.
converter = cattrs.Converter(forbid_extra_keys=True, unstruct_collection_overrides={Sequence: list})


#: ``value`` (a snapshot or any part of it) as plain JSON-ready data.
unstructure = converter.unstructure


class SnapshotShapeError(ValueError):
    """JSON that is not a snapshot of this shape: another version of agentkv, or not agentkv."""


def structure_snapshot(data: object) -> RuntimeSnapshot:
    """The snapshot ``data`` (parsed JSON) holds; :class:`SnapshotShapeError` naming the first
    field that differs when it holds another shape."""
    if not isinstance(data, dict):
        raise SnapshotShapeError(f"expected an object, got {type(data).__name__}")
    try:
        return converter.structure(data, RuntimeSnapshot)
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        raise SnapshotShapeError(_first_error(exc)) from exc


def _first_error(exc: BaseException) -> str:
    """The first leaf of a cattrs validation error, after the notes that say where it is."""
    notes: list[str] = []
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
        notes += [str(note) for note in getattr(exc, "__notes__", ())]
    return "; ".join([*notes, f"{type(exc).__name__}: {exc}"])
