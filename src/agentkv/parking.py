"""Parking evicted agent contexts, so that more agents than slots keep their KV cache.

With six agents on two slots, a slot is handed to another agent on almost every request, and the
agent that comes back finds its history gone: everything after the shared system prompt is
prefilled again. llama-server can save a slot's KV cache to a file and restore it into any slot
(``POST /slots/{id}?action=save|restore``, which needs ``--slot-save-path``). The parking lot
decides when to do that: before a miss overwrites a slot, park what it held (one file per agent,
replaced by that agent's next park); when an agent's request finds its own parked context a longer
prefix than what the chosen slot holds, restore it first.

Pure: it decides and remembers; the caller saves and restores.
"""

from __future__ import annotations

import hashlib

import attrs

from agentkv._types import Fingerprint, MatchKind
from agentkv.fingerprint import compare

__all__ = ["ParkedContext", "ParkingLot"]


@attrs.frozen
class ParkedContext:
    """One saved slot: whose it was, what prefix it holds, and the file llama-server wrote."""

    agent: str
    fingerprint: Fingerprint
    filename: str
    parked_at: float


@attrs.define
class ParkingLot:
    """At most one parked context per agent, at most ``capacity`` agents (oldest dropped).

    ``min_gain`` is how much longer (in fingerprint size units, characters of canonical JSON) a
    parked prefix must be than what the slot already shares with the request before a restore is
    worth its cost: a restore rewrites the whole slot, a small gain is cheaper to prefill.
    """

    capacity: int = 64
    min_gain: int = 1000
    _parked: dict[str, ParkedContext] = attrs.field(factory=dict)

    def filename(self, agent: str) -> str:
        """The file an agent's context is parked in: stable, so a new park replaces the old."""
        digest = hashlib.sha256(agent.encode()).hexdigest()[:20]
        return f"agentkv-{digest}.bin"

    def should_park(self, agent: str | None, fingerprint: Fingerprint | None) -> bool:
        """Whether the context a slot is about to lose is worth saving."""
        if agent is None or fingerprint is None or not fingerprint.blocks:
            return False
        parked = self._parked.get(agent)
        # Already parked as it is (the agent was restored and made no progress since).
        return parked is None or parked.fingerprint != fingerprint

    def park(self, agent: str, fingerprint: Fingerprint, now: float) -> ParkedContext:
        """Record that ``agent``'s context was saved; returns the entry (its file is replaced)."""
        entry = ParkedContext(agent, fingerprint, self.filename(agent), now)
        self._parked.pop(agent, None)
        self._parked[agent] = entry
        while len(self._parked) > self.capacity:
            del self._parked[next(iter(self._parked))]
        return entry

    def best(self, agent: str, request: Fingerprint | None, shared: int) -> ParkedContext | None:
        """The agent's parked context, if it is a prefix of ``request`` that beats ``shared``.

        ``shared`` is what the chosen slot already has in common with the request.
        """
        parked = self._parked.get(agent)
        if parked is None or request is None:
            return None
        match = compare(request, parked.fingerprint)
        if match.kind is MatchKind.MISS:
            return None
        return parked if match.shared_size >= shared + self.min_gain else None

    def forget(self, agent: str) -> None:
        self._parked.pop(agent, None)

    def table(self) -> list[dict[str, object]]:
        return [
            {"agent": p.agent, "prefix_blocks": len(p.fingerprint.blocks), "file": p.filename}
            for p in self._parked.values()
        ]
