"""The slot table: which llama-server slot holds which prefix, and who is using it.

llama-server runs one request per slot, so a slot is either idle (refcount 0) or leased to exactly
one request. :meth:`SlotManager.acquire` picks the idle slot whose KV cache saves the most prefill;
:meth:`SlotManager.release` records what the slot holds afterwards. A request that dies without
releasing (a bug, a lost task) would pin its slot forever, so :meth:`SlotManager.sweep` is a
watchdog that reclaims leases held past ``lease_ttl``.

Pure and single-threaded: time is passed in, nothing awaits, and callers serialise access.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import attrs

from agentkv._types import Fingerprint, Lease, Match, MatchKind, SlotView
from agentkv.fingerprint import compare

__all__ = ["SlotManager", "SlotStats"]


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _hits(request: Fingerprint, cached: Fingerprint) -> bool:
    return compare(request, cached).kind is not MatchKind.MISS


@attrs.frozen
class SlotStats:
    """Hit counters since the manager was created.

    ``saved_size`` sums the ``shared_size`` of every acquired match: the prefix (in characters of
    canonical JSON) that did not have to be prefilled again.
    """

    exact: int = 0
    prefix: int = 0
    miss: int = 0
    acquired: int = 0
    reclaimed: int = 0
    saved_size: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of acquisitions that were exact or prefix hits (0.0 before the first one)."""
        return (self.exact + self.prefix) / self.acquired if self.acquired else 0.0


@attrs.define
class _Slot:
    fingerprint: Fingerprint | None = None
    refcount: int = 0
    last_used: float | None = None
    agent: str | None = None
    lease_ids: list[int] = attrs.Factory(list)


@attrs.define(eq=False)
class SlotManager:
    """Hands out llama-server slots by cache affinity; never hands out a busy slot.

    ``acquire`` prefers, among idle slots: an exact hit, then the longest prefix hit, then an empty
    slot (keeping other agents' caches alive), then the slot sharing the most with the request
    (typically the common system prompt and tools), least recently used first. A slot that a
    *waiting* request would hit (``protect``) is evicted only when nothing else is left: with more
    agents than slots, plain LRU tends to evict exactly the agent that is next in line.
    """

    n_slots: int = attrs.field(validator=_positive)
    lease_ttl: float = attrs.field(default=600.0, kw_only=True, validator=_positive)
    _slots: list[_Slot] = attrs.field(init=False)
    _leases: dict[int, Lease] = attrs.field(init=False, factory=dict)
    _next_lease: int = attrs.field(init=False, default=1)
    _stats: SlotStats = attrs.field(init=False, factory=SlotStats)

    @_slots.default
    def _make_slots(self) -> list[_Slot]:
        return [_Slot() for _ in range(self.n_slots)]

    def _choose(
        self, fingerprint: Fingerprint | None, protect: Collection[Fingerprint] = ()
    ) -> tuple[int, Match] | None:
        best: tuple[tuple[int, int, float, int], int, Match] | None = None
        for index, slot in enumerate(self._slots):
            if slot.refcount > 0:
                continue
            if fingerprint is None:
                match = Match(MatchKind.MISS)
            else:
                match = compare(fingerprint, slot.fingerprint)
            if match.kind is MatchKind.EXACT:
                rank = 0
            elif match.kind is MatchKind.PREFIX:
                rank = 1
            elif slot.fingerprint is None:
                rank = 2
            elif any(_hits(waiting, slot.fingerprint) for waiting in protect):
                rank = 4
            else:
                rank = 3
            lru = -math.inf if slot.last_used is None else slot.last_used
            key = (rank, -match.shared_size, lru, index)
            if best is None or key < best[0]:
                best = (key, index, match)
        return None if best is None else (best[1], best[2])

    def peek(
        self, fingerprint: Fingerprint | None, protect: Collection[Fingerprint] = ()
    ) -> Match | None:
        """The match :meth:`acquire` would give now, without taking a slot; None if all are busy."""
        chosen = self._choose(fingerprint, protect)
        return None if chosen is None else chosen[1]

    def acquire(
        self,
        fingerprint: Fingerprint | None,
        now: float,
        *,
        agent: str = "",
        protect: Collection[Fingerprint] = (),
    ) -> Lease | None:
        """Lease the best idle slot for ``fingerprint``; None when every slot is busy.

        ``protect`` holds the fingerprints of requests still waiting: slots they would hit are
        evicted last.
        """
        chosen = self._choose(fingerprint, protect)
        if chosen is None:
            return None
        index, match = chosen
        slot = self._slots[index]
        overwritten = match.kind is MatchKind.MISS and slot.fingerprint is not None
        lease = Lease(
            id=self._next_lease,
            slot=index,
            match=match,
            agent=agent,
            acquired_at=now,
            fingerprint=fingerprint,
            evicted=slot.fingerprint if overwritten else None,
            evicted_agent=slot.agent if overwritten else None,
        )
        self._next_lease += 1
        slot.refcount += 1
        slot.last_used = now
        slot.agent = agent
        slot.lease_ids.append(lease.id)
        # While leased the slot is being filled with this request's prefix.
        slot.fingerprint = fingerprint
        self._leases[lease.id] = lease
        stats = self._stats
        self._stats = attrs.evolve(
            stats,
            exact=stats.exact + (match.kind is MatchKind.EXACT),
            prefix=stats.prefix + (match.kind is MatchKind.PREFIX),
            miss=stats.miss + (match.kind is MatchKind.MISS),
            acquired=stats.acquired + 1,
            saved_size=stats.saved_size + match.shared_size,
        )
        return lease

    def _drop(self, lease: Lease) -> _Slot:
        del self._leases[lease.id]
        slot = self._slots[lease.slot]
        slot.refcount = max(0, slot.refcount - 1)
        slot.lease_ids.remove(lease.id)
        return slot

    def release(self, lease: Lease, now: float, *, fingerprint: Fingerprint | None = None) -> bool:
        """Give the slot back; False (and no change) if the lease is no longer live.

        The slot's cached prefix becomes ``fingerprint`` (what the slot holds now, e.g. the request
        plus the reply) or, when that is None, the lease's own fingerprint.
        """
        if self._leases.get(lease.id) != lease:
            return False
        slot = self._drop(lease)
        slot.last_used = now
        slot.fingerprint = fingerprint if fingerprint is not None else lease.fingerprint
        return True

    def invalidate(self, slot: int) -> None:
        """Forget what ``slot`` holds (it was erased, or a request on it failed).

        On a leased slot, call it after :meth:`release`, which records a fingerprint again.
        """
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"no slot {slot}: slots are 0..{self.n_slots - 1}")
        self._slots[slot].fingerprint = None

    def sweep(self, now: float) -> list[Lease]:
        """Reclaim and return leases held longer than ``lease_ttl``, oldest id first.

        A reclaimed slot's cache is forgotten: the request may still be running on the engine,
        and nobody knows what the slot will hold when it stops.
        """
        expired = [
            lease for lease in self._leases.values() if now - lease.acquired_at > self.lease_ttl
        ]
        expired.sort(key=lambda lease: lease.id)
        for lease in expired:
            self._drop(lease).fingerprint = None
        if expired:
            self._stats = attrs.evolve(self._stats, reclaimed=self._stats.reclaimed + len(expired))
        return expired

    def table(self) -> list[SlotView]:
        """One read-only row per slot, in slot order."""
        return [
            SlotView(
                slot=index,
                fingerprint=slot.fingerprint,
                refcount=slot.refcount,
                last_used=slot.last_used,
                agent=slot.agent,
                lease_ids=tuple(slot.lease_ids),
            )
            for index, slot in enumerate(self._slots)
        ]

    def stats(self) -> SlotStats:
        """The hit counters so far."""
        return self._stats

    @property
    def free(self) -> int:
        """How many slots are idle."""
        return sum(1 for slot in self._slots if slot.refcount == 0)
