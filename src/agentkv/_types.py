"""Value objects shared by the scheduling components.

They are frozen attrs classes: cheap to compare, safe to hand between tasks, and easy to show in the
slot table. The components that create them (fingerprinter, slot manager, scheduler) own the logic.
"""

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
    "Match",
    "MatchKind",
    "SlotView",
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


class MatchKind(enum.Enum):
    """How a request relates to what a slot has cached."""

    # The slot holds exactly this prefix: nothing to prefill but the new tail.
    EXACT = "exact"
    # The slot's prefix is a prefix of this request: prefill only the extension.
    PREFIX = "prefix"
    # Diverges somewhere (``shared_blocks`` may still count common leading blocks).
    MISS = "miss"


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

    @property
    def short(self) -> str:
        """A short, human-readable id for logs and the slot table."""
        return self.blocks[-1][:12] if self.blocks else "-"


@attrs.frozen
class Match:
    """The result of comparing a request's fingerprint with a slot's cached one."""

    kind: MatchKind
    shared_blocks: int = 0
    shared_size: int = 0


@attrs.frozen
class Ticket:
    """One request waiting for its turn on the engine."""

    id: int
    agent: str
    priority: int  # 0 = most urgent … 3 = background / compaction
    arrival: float  # seconds, on the caller's clock
    fingerprint: Fingerprint | None = None
    payload: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Lease:
    """The right to use one slot until released. ``match`` says what the slot already held."""

    id: int
    slot: int
    match: Match
    agent: str
    acquired_at: float
    fingerprint: Fingerprint | None = None
    #: What the slot held before this lease (and whose it was), when that differs from the
    #: request: the context a miss is about to overwrite, which a caller may want to park.
    evicted: Fingerprint | None = None
    evicted_agent: str | None = None


@attrs.frozen
class SlotView:
    """A read-only row of the slot table."""

    slot: int
    fingerprint: Fingerprint | None
    refcount: int
    last_used: float | None
    agent: str | None
    lease_ids: tuple[int, ...] = ()
