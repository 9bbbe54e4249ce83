"""Value objects shared by the scheduling components: frozen, so safe to hand between tasks; the
components that create them (fingerprinter, slot manager, scheduler) own the logic."""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

__all__ = [
    "ANY_TOOL",
    "AnyTool",
    "Fingerprint",
    "ForcedTool",
    "Lease",
    "Placement",
    "SlotView",
    "Source",
    "Ticket",
]


class AnyTool(enum.Enum):
    """The type of :data:`ANY_TOOL` (an enum of one, so that type checkers can narrow on it)."""

    ANY_TOOL = "any tool"


#: A forced tool that is not one tool's name: ``tool_choice: any`` over several tools, or the retry
#: after a call written wrongly. The reply must call one of the declared tools, written as
#: ``{"name": ..., "arguments": {...}}``.
ANY_TOOL: Final = AnyTool.ANY_TOOL

#: What a reply is forced to call: one tool, by name, or :data:`ANY_TOOL`.
ForcedTool = str | AnyTool


@attrs.frozen
class Fingerprint:
    """A chain of block hashes over the stable prefix of a conversation.

    ``blocks[i]`` hashes everything up to and including block ``i`` (system, tools, then turns), so
    two fingerprints share a prefix of ``k`` blocks when their first ``k`` entries are equal.
    ``sizes[i]`` is the size of block ``i`` in characters, which weighs what a shared prefix saves.
    """

    blocks: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def total_size(self) -> int:
        return sum(self.sizes)


class Source(enum.Enum):
    """Where the cached part of a request's prompt comes from once its slot is prepared: the
    slot's own KV cache, a saved state restored from the prefix store first, or nothing."""

    SLOT = "slot"
    STORE = "store"
    NONE = "none"


@attrs.frozen
class Placement:
    """Where a request runs and what it finds there: the slot choice, as a value.

    ``reuse`` is the number of prompt tokens found cached once the slot is prepared (restored,
    when ``source`` is STORE); ``park`` says the slot's present content is worth saving to the
    store before it is overwritten; ``seconds`` is the estimated time until the prompt is computed.
    """

    slot: int
    reuse: int
    source: Source
    entry_id: str | None = None
    park: bool = False
    seconds: float = 0.0


@attrs.frozen
class Ticket:
    """One request waiting for its turn on the engine."""

    id: int
    agent: str
    priority: int  # 0 = most urgent … 3 = background / compaction
    arrival: float  # seconds, on the caller's clock
    #: The prompt in tokens, when known: what decides the slot.
    tokens: tuple[int, ...] = attrs.field(default=(), repr=lambda t: f"<{len(t)} tokens>")
    #: Where the prompt's shareable head ends (tokens), when known: a long head that nothing
    #: holds yet is computed and saved on its own first, for other requests to restore.
    head: int | None = None
    payload: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Lease:
    """The right to use one slot until released. ``placement`` says what the slot will hold."""

    id: int
    slot: int
    agent: str
    acquired_at: float
    placement: Placement
    tokens: tuple[int, ...] = attrs.field(default=(), repr=lambda t: f"<{len(t)} tokens>")
    #: What the slot held before this lease and whose it was: the context that a caller parks
    #: (``placement.park``) before the request overwrites it.
    evicted: tuple[int, ...] = attrs.field(default=(), repr=lambda t: f"<{len(t)} tokens>")
    evicted_agent: str | None = None


@attrs.frozen
class SlotView:
    """A read-only row of the slot table."""

    slot: int
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    #: A request holds the slot (llama-server runs one request per slot: never two).
    held: bool
    last_used: float | None
    agent: str | None
    lease_ids: tuple[int, ...] = ()
    #: The store entry that holds all of ``tokens``: overwriting the slot then loses nothing.
    stored: str | None = None
    #: The prompt sections (label, digest) of the request that left ``tokens`` there.
    sections: tuple[tuple[str, str], ...] = ()

    @property
    def refcount(self) -> int:
        """Deprecated: :attr:`held` as a number (a slot is only ever held once)."""
        return int(self.held)
