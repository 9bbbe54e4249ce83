"""The slot table: which tokens each llama-server slot holds, who uses it, and where a request goes.

llama-server reuses, for each request, the longest common token prefix of the slot's KV cache and
the new prompt, so the table records each slot's content as tokens and :func:`place` chooses a
slot by cost: the prefill left to do plus what overwriting the slot's content destroys.
:meth:`SlotManager.sweep` reclaims leases that have shown no sign of life for ``lease_ttl``
seconds (a request that died without releasing). Pure and single-threaded: time is passed in,
nothing awaits, and callers serialise access.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import attrs

from agentkv._types import Lease, Placement, SlotView, Source
from agentkv.costs import CostModel
from agentkv.snapshot import Placements
from agentkv.store import StoreIndex
from agentkv.tokens import Tokens, common_prefix

__all__ = [
    "DEFAULT_LEASE_TTL",
    "ContentWriter",
    "SlotManager",
    "SlotReader",
    "SlotStats",
    "place",
]

#: Seconds without a sign of life after which a lease counts as leaked (the runtime's setting
#: takes it from here).
DEFAULT_LEASE_TTL = 900.0

#: Chance that the owner of overwritten content comes back for it: what a destroyed token is
#: expected to cost later (a restore when it was saved, a prefill when not).
_RETURN_CHANCE = 0.5


@attrs.frozen
class SlotStats:
    """Counters since the manager was created.

    ``reused_tokens`` sums the prompt tokens found cached (in the slot or restored);
    ``computed_tokens`` the ones left to prefill, as planned at acquisition.
    """

    acquired: int = 0
    from_slot: int = 0
    from_store: int = 0
    cold: int = 0
    reclaimed: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of acquisitions that reused cached tokens (0.0 before the first one)."""
        return (self.from_slot + self.from_store) / self.acquired if self.acquired else 0.0

    def view(self) -> Placements:
        """The counters as the operator's view shows them."""
        return Placements(
            acquired=self.acquired,
            from_slot=self.from_slot,
            from_store=self.from_store,
            cold=self.cold,
            reclaimed=self.reclaimed,
            hit_rate=round(self.hit_rate, 4),
            planned_reused_tokens=self.reused_tokens,
            planned_computed_tokens=self.computed_tokens,
        )


def place(
    tokens: Tokens,
    idle: Sequence[SlotView],
    costs: CostModel,
    *,
    store: StoreIndex | None = None,
    park_min: int = 256,
    keep: Collection[str] = (),
) -> Placement | None:
    """The cheapest idle slot for a prompt of ``tokens``, and how to prepare it; None if none idle.

    Each idle slot is priced from its own cache and from the store entry sharing the most tokens
    with the prompt: the prefill left, plus saving the slot's content when it is worth parking
    (``park_min`` tokens would be lost, it is not stored yet, a store exists), plus the expected
    later cost of what is overwritten. Ties go to the slot used least recently. A slot whose agent
    is in ``keep`` (a coordinator waiting for its sub-agents) will certainly be wanted again: it
    is parked whatever its size, and its loss counts in full rather than by :data:`_RETURN_CHANCE`.
    """
    if not idle:
        return None
    n = len(tokens)
    best_entry = store.best(tokens) if store is not None else None
    candidates: list[tuple[tuple[float, float], Placement]] = []
    for view in idle:
        held = len(view.tokens)
        own = common_prefix(tokens, view.tokens)
        saved = view.stored is not None
        kept_warm = view.agent is not None and view.agent in keep
        chance = 1.0 if kept_warm else _RETURN_CHANCE
        lru = -math.inf if view.last_used is None else view.last_used
        options: list[tuple[int, Source, str | None, float]] = [
            (own, Source.SLOT if own else Source.NONE, None, 0.0)
        ]
        if best_entry is not None and best_entry[1] > own:
            entry, shared = best_entry
            options.append((shared, Source.STORE, entry.id, costs.restore.estimate(entry.nbytes)))
        for reuse, source, entry_id, restore_s in options:
            # A restore replaces the slot's whole content; its own cache keeps the shared part.
            kept = own if source is not Source.STORE else 0
            lost = held - kept
            big = lost >= park_min or kept_warm
            park = store is not None and not saved and big and lost > 0
            park_s = costs.save.estimate(costs.state_bytes(held)) if park else 0.0
            if lost <= 0:
                later = 0.0
            elif saved or park:
                later = chance * costs.restore.estimate(costs.state_bytes(held))
            else:
                later = chance * costs.prefill.estimate(kept, lost)
            seconds = restore_s + park_s + costs.prefill.estimate(reuse, n - reuse)
            placement = Placement(view.slot, reuse, source, entry_id, park, seconds)
            candidates.append(((seconds + later, lru), placement))
    return min(candidates, key=lambda candidate: candidate[0])[1]


@attrs.define
class _Slot:
    """One slot's row: the fields of :class:`SlotView` but its index."""

    tokens: Tokens = ()
    held: bool = False
    last_used: float | None = None
    agent: str | None = None
    lease_ids: list[int] = attrs.Factory(list)
    stored: str | None = None
    sections: tuple[tuple[str, str], ...] = ()


@attrs.define(eq=False)
class SlotReader:
    """The slot table as everyone may read it: the dispatcher hands this face out, so a reader
    cannot write what a slot holds nor who holds it (the type checker says so)."""

    n_slots: int = attrs.field(validator=attrs.validators.gt(0))
    _slots: list[_Slot] = attrs.field(init=False)
    _leases: dict[int, Lease] = attrs.field(init=False, factory=dict)
    _stats: SlotStats = attrs.field(init=False, factory=SlotStats)
    #: Slots out of placement: their engine is down (a pool of engines).
    _out: set[int] = attrs.field(init=False, factory=set)

    @_slots.default
    def _make_slots(self) -> list[_Slot]:
        return [_Slot() for _ in range(self.n_slots)]

    def _view(self, index: int) -> SlotView:
        slot = self._slots[index]
        fields = attrs.asdict(slot, recurse=False)
        return SlotView(index, **{**fields, "lease_ids": tuple(slot.lease_ids)})

    def idle(self) -> list[SlotView]:
        """The slots no request holds and placement may use, in slot order."""
        return [self._view(i) for i in self._idle()]

    def _idle(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if not slot.held and i not in self._out]

    def is_out(self, slot: int) -> bool:
        """Whether ``slot`` is out of placement."""
        return slot in self._out

    def place(
        self,
        tokens: Tokens,
        costs: CostModel,
        *,
        store: StoreIndex | None = None,
        park_min: int = 256,
        keep: Collection[str] = (),
    ) -> Placement | None:
        """:func:`place` over this table's idle slots."""
        return place(tokens, self.idle(), costs, store=store, park_min=park_min, keep=keep)

    def lease(self, lease_id: int) -> Lease | None:
        """The live lease with this id, if any."""
        return self._leases.get(lease_id)

    def table(self) -> list[SlotView]:
        """One read-only row per slot, in slot order."""
        return [self._view(i) for i in range(self.n_slots)]

    def stats(self) -> SlotStats:
        return self._stats

    @property
    def free(self) -> int:
        """How many slots are idle and in placement."""
        return len(self._idle())

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"no slot {slot}: slots are 0..{self.n_slots - 1}")


@attrs.define(eq=False)
class ContentWriter(SlotReader):
    """The writer of what each slot holds, and the only one: the dispatcher that creates the
    table hands this face to the slot-content owner once. Who holds a slot (leases) is written
    by the dispatcher alone, through the :class:`SlotManager` it keeps to itself."""

    def set_content(
        self,
        slot: int,
        tokens: Tokens,
        *,
        stored: str | None = None,
        sections: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Record what a slot holds now (after a restore, a park or a finished request)."""
        self._check(slot)
        content = self._slots[slot]
        content.tokens, content.stored, content.sections = tuple(tokens), stored, sections

    def mark_stored(self, slot: int, entry_id: str | None) -> None:
        """The slot's content is (or, with None, is no longer) held by a store entry."""
        self._check(slot)
        self._slots[slot].stored = entry_id

    def forget_entry(self, entry_id: str) -> None:
        """A store entry is gone: slots it covered now hold unsaved content."""
        for slot in self._slots:
            if slot.stored == entry_id:
                slot.stored = None

    def invalidate(self, slot: int) -> None:
        """Forget what ``slot`` holds (it was erased, or a request on it failed)."""
        self.set_content(slot, ())

    def take_out(self, slots: Collection[int]) -> None:
        """Keep ``slots`` out of placement (their engine is down) and forget what they held.

        Leases on them stay live until released: the requests running there end on their own.
        """
        for slot in slots:
            self.invalidate(slot)
            self._out.add(slot)

    def bring_back(self, slots: Collection[int]) -> None:
        """Put ``slots`` back into placement, empty (their engine rejoined, or restarted)."""
        for slot in slots:
            self.invalidate(slot)
            self._out.discard(slot)


@attrs.define(eq=False)
class SlotManager(ContentWriter):
    """The slot table of one engine: content, leases and a watchdog. Never leases a busy slot.

    Its writers come in two faces: the leases (``acquire``, ``release``, ``touch``, ``sweep``)
    for the one dispatcher that creates the table, and :class:`ContentWriter` for the one owner of
    what slots hold; everyone else reads it as a :class:`SlotReader`.
    """

    lease_ttl: float = attrs.field(
        default=DEFAULT_LEASE_TTL, kw_only=True, validator=attrs.validators.gt(0)
    )
    #: When each live lease last showed a sign of life (engine progress), if after acquisition.
    _alive_at: dict[int, float] = attrs.field(init=False, factory=dict)
    _next_lease: int = attrs.field(init=False, default=1)

    def acquire(self, placement: Placement, now: float, *, agent: str, tokens: Tokens) -> Lease:
        """Lease the slot ``placement`` names for a request of ``tokens``.

        Raises ValueError when that slot is busy: a placement is only valid until the table
        changes, so callers place and acquire in one step.
        """
        self._check(placement.slot)
        slot = self._slots[placement.slot]
        if slot.held:
            raise ValueError(f"slot {placement.slot} is busy")
        lease = Lease(
            id=self._next_lease,
            slot=placement.slot,
            agent=agent,
            acquired_at=now,
            placement=placement,
            tokens=tokens,
            evicted=slot.tokens,
            evicted_agent=slot.agent,
        )
        self._next_lease += 1
        slot.held, slot.last_used, slot.agent = True, now, agent
        slot.lease_ids.append(lease.id)
        self._leases[lease.id] = lease
        stats = self._stats
        source = placement.source
        self._stats = attrs.evolve(
            stats,
            acquired=stats.acquired + 1,
            from_slot=stats.from_slot + (source is Source.SLOT),
            from_store=stats.from_store + (source is Source.STORE),
            cold=stats.cold + (source is Source.NONE),
            reused_tokens=stats.reused_tokens + placement.reuse,
            computed_tokens=stats.computed_tokens + max(0, len(tokens) - placement.reuse),
        )
        return lease

    def release(
        self,
        lease: Lease,
        now: float,
        *,
        holds: Tokens | None,
        sections: tuple[tuple[str, str], ...] | None = None,
    ) -> bool:
        """Give the slot back; False (and no change) if the lease is no longer live.

        ``holds`` is what the slot's cache holds now (None when unknown, e.g. after a failure:
        the slot then counts as empty, which never promises a cache that is not there);
        ``sections`` describe the prompt that left it there.
        """
        if self._leases.get(lease.id) != lease:
            return False
        slot = self._drop(lease)
        slot.last_used = now
        if holds is None:
            self.set_content(lease.slot, ())
        elif tuple(holds) != slot.tokens:
            self.set_content(lease.slot, holds, sections=sections or ())
        elif sections is not None:
            slot.sections = sections
        return True

    def touch(self, lease_id: int, now: float) -> bool:
        """The request holding ``lease_id`` made progress at ``now`` (the engine reported
        computed or generated tokens): the watchdog's clock for it starts again. False when
        the lease is no longer live."""
        if lease_id not in self._leases:
            return False
        self._alive_at[lease_id] = max(now, self._alive_at.get(lease_id, now))
        return True

    def sweep(self, now: float) -> list[Lease]:
        """Reclaim and return leases silent for longer than ``lease_ttl``, oldest id first.

        Silent means: neither acquired nor touched (:meth:`touch`) within ``lease_ttl``. A
        reclaimed slot's cache is forgotten: the request may still be running on the engine,
        and nobody knows what the slot will hold when it stops.
        """
        by_id, alive = sorted(self._leases.values(), key=lambda lease: lease.id), self._alive_at
        expired = [x for x in by_id if now - alive.get(x.id, x.acquired_at) > self.lease_ttl]
        for lease in expired:
            slot = self._drop(lease)
            slot.tokens, slot.stored = (), None
        if expired:
            self._stats = attrs.evolve(self._stats, reclaimed=self._stats.reclaimed + len(expired))
        return expired

    def _drop(self, lease: Lease) -> _Slot:
        del self._leases[lease.id]
        self._alive_at.pop(lease.id, None)
        slot = self._slots[lease.slot]
        slot.held = False
        slot.lease_ids.remove(lease.id)
        return slot
