"""The scheduling layer at run time: tickets wait in the FairScheduler, slots come as leases.

The pure components decide (:class:`~agentkv.FairScheduler` the order, :func:`agentkv.slots.place`
the slot); this module only waits and wakes, whenever a ticket arrives, a lease comes back or a
shared prefix is saved (nothing polls). It runs on one event loop and the sections between awaits
are atomic, so no lock is needed. Waiting is deliberate rather than first come, first served:

- **Checkpoints.** A request computing a long prefix others may share (a fresh agent's system
  prompt, tools and session context) announces it; a request sharing most of it waits for it to
  be saved and restores it, when that is estimated to be sooner than computing it in parallel.
- **Pre-emption.** A request that finds every slot busy with less urgent work may have one
  suspended: that request's progress is saved, and it resumes later from where it stopped.
- **Urgency lent to a checkpoint.** The request computing a checkpoint runs at its most urgent
  waiter's priority until it is saved: a priority-0 sub-agent waiting for the head its background
  sibling computes gets the engine to itself for that head. The slot a suspension frees goes to
  the request it was suspended for.
- **Quiet while urgent.** Prompts computed next to an urgent request share its batches (a CPU
  computes them in turns of hundreds of tokens), so its first token waits for everyone's prefill.
  While a priority-0 request holds a slot, less urgent prefills are suspended and queued ones wait
  — unless their prompt is (nearly) all cached, or aging has brought them to priority 0, which
  keeps every wait bounded (for a suspended request, aging counts from its suspension).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import anyio
import attrs

from agentkv._types import Lease, Placement, SlotView, Source, Ticket
from agentkv.costs import CostModel
from agentkv.runtime.config import RuntimeConfig
from agentkv.scheduler import FairScheduler
from agentkv.slots import ContentWriter, SlotManager, SlotReader
from agentkv.snapshot import (
    BackgroundRow,
    CheckpointRow,
    DispatcherSnapshot,
    QueueRow,
    SlotRow,
    SlotState,
)
from agentkv.store import StoreIndex
from agentkv.tokens import Tokens, common_prefix

__all__ = ["Checkpoint", "Dispatcher"]

log = logging.getLogger("agentkv.dispatcher")


@attrs.define(eq=False)
class Checkpoint:
    """A prefix being computed on a slot, to be saved for other requests when done."""

    id: int
    tokens: Tokens = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    slot: int
    agent: str
    started: float
    #: Prompt tokens cached or computed so far (llama-server's prompt progress).
    progress: int = 0
    done: bool = False


@attrs.define(eq=False)
class _Waiter:
    ticket: Ticket
    event: anyio.Event = attrs.field(factory=anyio.Event)
    lease: Lease | None = None
    #: A checkpoint this ticket waits for (it restores it rather than computing it again).
    blocked_on: Checkpoint | None = None

    @property
    def waiting(self) -> bool:
        """It waits for a slot: not granted one, not waiting for a checkpoint."""
        return self.lease is None and self.blocked_on is None


@attrs.define(eq=False)
class _Held:
    """One lease, from its grant to its end: all the dispatcher keeps of it, created by
    :meth:`Dispatcher._grant` and removed by :meth:`Dispatcher._end` alone."""

    lease: Lease
    #: The ticket it was granted for (its agent and arrival name the request).
    ticket: Ticket
    #: The order in which it was handed out (1, 2, …).
    seq: int
    #: The head its request computes and saves first for others.
    checkpoint: Checkpoint | None = None
    #: The store entry it was placed to restore, pinned (with its index) until the lease ends.
    pinned: tuple[StoreIndex, str] | None = None
    #: Being suspended for this ticket, which gets the slot it gives back.
    reserved_for: int | None = None
    #: Its request declared itself running; until then it is preparing the slot.
    declared: bool = False
    #: The urgency it runs at now: its own, or that of its checkpoint's most urgent waiter.
    priority: int = attrs.field(default=attrs.Factory(lambda self: self.ticket.priority, True))
    #: Its own priority.
    own: int = attrs.field(default=attrs.Factory(lambda self: self.ticket.priority, True))
    #: Suspends the request (it saves its progress and gives the slot up); None: not now.
    suspend: Callable[[], None] | None = None
    #: Granted from the background lane and not promoted since: it gives its slot to any
    #: foreground ticket that finds none free.
    background: bool = False
    #: Stops a background request that cannot be suspended (its work is lost).
    give_up: Callable[[], None] | None = None
    decoding: bool = False
    suspending: bool = False


@attrs.define
class Dispatcher:
    """Owns the slot table and the queues of one engine and hands out leases fairly.

    ``store_index`` answers the prefix store's index while there is one (its owner holds it; the
    dispatcher only reads it). ``costs`` prices prefill, save and restore.
    """

    config: RuntimeConfig
    #: While a priority-0 request runs, a less urgent ticket that would compute more prompt
    #: tokens than this waits (with pre-emption on).
    quiet_min: int = 64
    costs: CostModel = attrs.field(factory=CostModel)
    store_index: Callable[[], StoreIndex | None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    #: Agents whose context is worth keeping now (a coordinator waiting for its sub-agents): a
    #: slot holding one is overwritten last, and is parked first whatever its size.
    warm: Callable[[], frozenset[str]] | None = None
    _slots: SlotManager = attrs.field(init=False)
    _contents_handed: bool = attrs.field(init=False, default=False)
    _scheduler: FairScheduler = attrs.field(init=False)
    #: Background work (compaction): dispatched only while no foreground ticket waits.
    _background: FairScheduler = attrs.field(init=False)
    _waiters: dict[int, _Waiter] = attrs.field(init=False, factory=dict)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _dispatched: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    #: Every lease handed out and not yet ended, by lease id.
    _held: dict[int, _Held] = attrs.field(init=False, factory=dict)
    _checkpoints: dict[int, Checkpoint] = attrs.field(init=False, factory=dict)
    #: (agent, arrival) of a request suspended for urgent work → when: while urgent work runs,
    #: the quiet rule counts its aging from then (its queue order keeps its whole wait).
    _quiet_since: dict[tuple[str, float], float] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._slots = SlotManager(self.config.n_slots, lease_ttl=self.config.lease_ttl)
        self._scheduler = FairScheduler(
            aging=self.config.aging,
            max_queue=self.config.max_queue,
            tie_window=self.config.tie_window,
        )
        self._background = FairScheduler(aging=self.config.aging, max_queue=self.config.max_queue)

    @property
    def slots(self) -> SlotReader:
        """The slot table, to read (leases are written here, contents by their owner)."""
        return self._slots

    def hand_contents(self) -> ContentWriter:
        """The slot table's content writer, for its one owner (the runtime's
        :class:`~agentkv.runtime.contents.SlotContents`): handed out once."""
        if self._contents_handed:
            raise RuntimeError("the slot contents already have their owner")
        self._contents_handed = True
        return self._slots

    @property
    def store(self) -> StoreIndex | None:
        """The prefix store's index now (None: no store), as its owner answers."""
        return self.store_index()

    # -- tickets --------------------------------------------------------------------------------

    def submit(
        self,
        agent: str,
        priority: int,
        tokens: Tokens = (),
        *,
        head: int | None = None,
        background: bool = False,
        arrival: float | None = None,
    ) -> Ticket:
        """Queue a ticket (QueueFullError at the cap); dispatch at once if a slot is free.

        A ``background`` ticket gets a slot only when no foreground ticket waits, and gives it up
        to a foreground ticket that finds none free: background work never delays an agent's
        request. A suspended request comes back with its original ``arrival`` (its aging credit).
        """
        ticket = Ticket(
            id=next(self._ids),
            agent=agent,
            priority=priority,
            arrival=self.clock() if arrival is None else arrival,
            tokens=tuple(tokens),
            head=head,
        )
        (self._background if background else self._scheduler).submit(ticket, ticket.arrival)
        waiter = _Waiter(ticket)
        self._waiters[ticket.id] = waiter
        if not background:
            self._block(waiter)
        self._dispatch()
        if not background and waiter.waiting:
            self._make_room(ticket)
        return ticket

    def requeue(
        self, ticket: Ticket, *, priority: int | None = None, background: bool = False
    ) -> Ticket:
        """Queue a suspended request's ticket again: same agent, tokens and head, its priority
        (or ``priority``) and its lane, and its original arrival (it keeps its aging credit)."""
        return self.submit(
            ticket.agent,
            ticket.priority if priority is None else priority,
            ticket.tokens,
            head=ticket.head,
            arrival=ticket.arrival,
            background=background,
        )

    def promote(self, ticket: Ticket, priority: int) -> None:
        """Background work becomes foreground work of ``priority``: queued in the background
        lane, its ticket moves to the foreground queue (same arrival); holding a slot, it keeps
        it from now on and runs at least that urgent."""
        queued = self._background.cancel(ticket.id)
        if queued is None:
            for held in self._held.values():
                if held.ticket.id == ticket.id and held.background:
                    held.background, held.give_up = False, None
                    held.own = min(held.own, priority)
                    held.priority = min(held.priority, priority)
            return  # dispatched (or already foreground)
        waiter = self._queue_at(queued, priority)
        self._dispatch()
        if waiter is not None and waiter.waiting:
            self._make_room(waiter.ticket)

    def reprioritise(self, agent: str, priority: int) -> None:
        """Queued foreground tickets of ``agent`` take ``priority`` (each keeps its arrival, so
        its aging credit and the starvation bound hold at the new priority)."""
        for ticket, _ in self._scheduler.queued(self.clock()):
            if ticket.agent == agent and ticket.priority != priority:
                log.debug(
                    "ticket %d (agent %s): priority %d → %d",
                    ticket.id,
                    agent,
                    ticket.priority,
                    priority,
                )
                self._scheduler.cancel(ticket.id)
                waiter = self._queue_at(ticket, priority)
                if waiter is not None and waiter.blocked_on is not None:
                    self._lend(waiter.blocked_on)
        self._dispatch()

    def _queue_at(self, ticket: Ticket, priority: int) -> _Waiter | None:
        """``ticket``, taken out of its queue, goes into the foreground queue at ``priority``
        (same arrival); returns its waiter."""
        moved = attrs.evolve(ticket, priority=priority)
        self._scheduler.submit(moved, moved.arrival)
        waiter = self._waiters.get(ticket.id)
        if waiter is not None:
            waiter.ticket = moved
        return waiter

    async def wait(self, ticket: Ticket) -> Lease:
        """Wait for the ticket's lease. Cancellation withdraws the ticket or returns the lease."""
        waiter = self._waiters.get(ticket.id)
        if waiter is None:
            raise RuntimeError(f"ticket {ticket.id} is not known to this dispatcher")
        try:
            await waiter.event.wait()
        except BaseException:
            self._withdraw(waiter)  # synchronous: cancellation cannot interrupt it
            raise
        del self._waiters[ticket.id]
        assert waiter.lease is not None
        return waiter.lease

    def withdraw(self, ticket: Ticket) -> None:
        """Forget a ticket that will never be waited for (its request failed before waiting)."""
        waiter = self._waiters.get(ticket.id)
        if waiter is not None:
            self._withdraw(waiter)

    def release(
        self,
        lease: Lease,
        *,
        holds: Tokens | None,
        sections: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        """Return a lease; ``holds`` is what the slot's cache holds now (None: unknown), left
        there by a prompt of ``sections``."""
        self._slots.release(lease, self.clock(), holds=holds, sections=sections)
        self._end(lease.id)
        self._dispatch()

    def dispatch_seq(self, lease: Lease) -> int | None:
        """The order in which this lease was handed out (1, 2, …), while it is held."""
        held = self._held.get(lease.id)
        return None if held is None else held.seq

    def _end(self, lease_id: int) -> None:
        """The one place a lease's record ends, once its slot is back (released or reclaimed):
        its store pin goes, the slot goes to the ticket it was suspended for, and a checkpoint
        it never saved lets its waiters go (they find the head in this slot if the request
        ended well and only its save failed)."""
        held = self._held.pop(lease_id, None)
        if held is None:
            return
        if held.pinned is not None:
            index, entry_id = held.pinned
            index.unpin(entry_id)
        if held.reserved_for is not None:
            self._dispatch_reserved(held.reserved_for)
        if held.checkpoint is not None and not held.checkpoint.done:
            self.end_checkpoint(held.checkpoint)

    def _declared(self) -> list[_Held]:
        """The leases whose requests declared themselves running."""
        return [held for held in self._held.values() if held.declared]

    # -- running requests and pre-emption -----------------------------------------------------

    def declare_running(
        self,
        lease: Lease,
        priority: int,
        suspend: Callable[[], None] | None = None,
        give_up: Callable[[], None] | None = None,
    ) -> None:
        """Declare a leased request; ``suspend`` lets a more urgent request take its slot.

        An urgent one (priority 0, pre-emption on) suspends the less urgent prefills on other
        slots. Background work gives its slot to any foreground ticket that finds none free:
        suspended when it can be, else stopped by ``give_up``.
        """
        running = self._held.get(lease.id)
        if running is None:
            return  # already ended (the watchdog reclaimed it)
        running.declared, running.suspend = True, suspend
        running.own = running.priority = priority
        if running.background:
            running.give_up = give_up
            # A foreground ticket may have come between the grant and now.
            for ticket, _ in self._scheduler.queued(self.clock()):
                if ticket.id in self._waiters and self._waiters[ticket.id].waiting:
                    self._give_way_to(ticket)
        if running.checkpoint is not None:
            running.priority = min(priority, self._waiting_urgency(running.checkpoint))
        if running.priority == 0:
            self._quiet_for(running)

    def _make_room(self, ticket: Ticket) -> None:
        """A foreground ``ticket`` found no free slot: less urgent or background work may
        give it one (pre-emption)."""
        self._preempt_for(ticket)
        self._give_way_to(ticket)

    def _give_way_to(self, ticket: Ticket) -> None:
        """A foreground ``ticket`` found no free slot: background work holding one gives it up
        (the latest started; suspended if it can be, else stopped), and the slot goes to
        ``ticket``. One slot per ticket."""
        if self._slots.free:
            return
        if any(held.reserved_for == ticket.id for held in self._held.values()):
            return  # a slot is already being freed for it
        candidates = [
            held
            for held in self._declared()
            if held.background
            and not held.suspending
            and (held.suspend is not None or held.give_up is not None)
        ]
        if not candidates:
            return
        victim = max(candidates, key=lambda held: held.lease.acquired_at)
        victim.reserved_for = ticket.id
        self._suspend(victim, f"ticket {ticket.id} (agent {ticket.agent}) needs a slot", stop=True)

    def _quiet_for(self, urgent: _Held) -> None:
        """An urgent request suspends the less urgent prefills on other slots."""
        for other in self._quiet_candidates(exclude=urgent.lease.id):
            self._suspend(other, f"lease {urgent.lease.id} (priority 0) runs")

    def _quiet_candidates(self, *, exclude: int) -> list[_Held]:
        """The running requests an urgent one quiets: less urgent, still computing a prompt."""
        return [o for o in self._less_urgent() if o.lease.id != exclude and not o.decoding]

    def _less_urgent(self) -> list[_Held]:
        """Running requests that urgent work may suspend (and not being suspended already)."""
        return [
            held for held in self._declared() if not held.suspending and self._yields(held.priority)
        ]

    def _yields(self, priority: int) -> bool:
        """Work of ``priority`` gives way to a priority-0 request (pre-emption on)."""
        preempt_from = self.config.preempt_from
        return preempt_from is not None and priority >= max(preempt_from, 1)

    def note_progress(self, lease: Lease) -> None:
        """The engine reported progress for ``lease`` (prompt computed, tokens generated): the
        watchdog leaves it alone for another ``lease_ttl``, however long its prefill runs."""
        self._slots.touch(lease.id, self.clock())

    def note_decoding(self, lease: Lease, *, suspendable: bool = False) -> None:
        """The request's prompt is computed; it now generates. Unless ``suspendable`` (its reply
        can be continued by a later engine call), it keeps its slot to the end."""
        running = self._held.get(lease.id)
        if running is not None and running.declared:
            first = not running.decoding
            running.decoding = True
            if not suspendable:
                running.suspend = None
            if first and self._slots.free:
                self._dispatch()  # a ticket held back for this first token may go now

    def _preempt_for(self, ticket: Ticket) -> None:
        if ticket.priority > 0:
            return
        victims = [running for running in self._less_urgent() if running.suspend is not None]
        if not victims:
            return
        # The least urgent; among those, one still computing its prompt, then the latest started.
        victim = max(victims, key=lambda r: (r.priority, not r.decoding, r.lease.acquired_at))
        victim.reserved_for = ticket.id
        self._suspend(victim, f"ticket {ticket.id} (priority {ticket.priority}) needs a slot")
        # Quiet while urgent would suspend the other less urgent prefills once the ticket runs;
        # now, they all stop at the end of the engine batch in progress, not one after another.
        for other in self._quiet_candidates(exclude=victim.lease.id):
            if other.reserved_for is None:
                other.reserved_for = ticket.id
            self._suspend(other, f"ticket {ticket.id} (priority 0) is about to run")

    def _suspend(self, running: _Held, reason: str, *, stop: bool = False) -> None:
        """Take ``running``'s slot: it saves its progress and gives the slot up; with ``stop``, a
        background request that cannot be suspended is stopped instead (its work is lost)."""
        if running.suspending:
            return
        if running.suspend is None:
            if stop and running.give_up is not None:
                running.suspending = True
                log.info(
                    "stopping background lease %d (agent %s): %s",
                    running.lease.id,
                    running.lease.agent,
                    reason,
                )
                running.give_up()
            return
        running.suspending = True
        ticket = running.ticket
        self._quiet_since[(ticket.agent, ticket.arrival)] = self.clock()
        while len(self._quiet_since) > 1024:  # requests that never came back
            self._quiet_since.pop(next(iter(self._quiet_since)))
        log.info(
            "suspending lease %d (agent %s, priority %d): %s",
            running.lease.id,
            running.lease.agent,
            running.priority,
            reason,
        )
        running.suspend()

    def _urgent_running(self) -> bool:
        """A priority-0 request holds a slot: running, or granted and preparing it (restoring
        its context) — a slot given back meanwhile must not start a less urgent prefill."""
        if self.config.preempt_from is None:
            return False
        # Until it is declared running a lease's urgency is its ticket's.
        return any(held.priority == 0 for held in self._held.values())

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_of(self, lease: Lease) -> Checkpoint | None:
        """The head this lease's request must compute and save first, if one was planned."""
        held = self._held.get(lease.id)
        return None if held is None else held.checkpoint

    def _plan_checkpoint(self, held: _Held) -> None:
        """Decided at dispatch, so that requests dispatched right after see it and wait."""
        ticket, lease = held.ticket, held.lease
        head, store = ticket.head, self.store
        if (
            store is None
            or head is None
            or head - lease.placement.reuse < self.config.split_min
            or store.covers(ticket.tokens[:head], slack=16) is not None
        ):
            return
        checkpoint = Checkpoint(
            id=next(self._ids),
            tokens=ticket.tokens[:head],
            slot=lease.slot,
            agent=lease.agent,
            started=self.clock(),
            progress=lease.placement.reuse,
        )
        self._checkpoints[checkpoint.id] = checkpoint
        held.checkpoint = checkpoint
        log.debug(
            "checkpoint %d: %d tokens on slot %d (lease %d, agent %s)",
            checkpoint.id,
            len(checkpoint.tokens),
            lease.slot,
            lease.id,
            lease.agent,
        )
        # Requests already queued may prefer to wait for it.
        for waiter in list(self._waiters.values()):
            if waiter.waiting:
                self._block(waiter)

    def _waiting_urgency(self, checkpoint: Checkpoint) -> int:
        """The most urgent priority among the tickets waiting for ``checkpoint`` (4: none)."""
        return min(
            (w.ticket.priority for w in self._waiters.values() if w.blocked_on is checkpoint),
            default=4,
        )

    def _lend(self, checkpoint: Checkpoint) -> None:
        """The request computing ``checkpoint`` runs at the urgency of its most urgent waiter
        (never less urgent than its own); at priority 0 it quiets the engine for itself."""
        for running in self._declared():
            if running.checkpoint is not checkpoint:
                continue
            urgency = min(running.own, self._waiting_urgency(checkpoint))
            if urgency < running.priority:
                log.info(
                    "lease %d (agent %s) computes checkpoint %d at priority %d for its waiters",
                    running.lease.id,
                    running.lease.agent,
                    checkpoint.id,
                    urgency,
                )
                running.priority = urgency
                if urgency == 0:
                    self._quiet_for(running)

    def _block(self, waiter: _Waiter) -> None:
        """``waiter`` waits for the checkpoint it is estimated to gain most from, if any."""
        waiter.blocked_on = self._worth_waiting_for(waiter.ticket.tokens)
        if waiter.blocked_on is not None:
            log.debug(
                "ticket %d (agent %s, priority %d) waits for checkpoint %d",
                waiter.ticket.id,
                waiter.ticket.agent,
                waiter.ticket.priority,
                waiter.blocked_on.id,
            )
            self._lend(waiter.blocked_on)

    def checkpoint_progress(self, checkpoint: Checkpoint, computed: int) -> None:
        checkpoint.progress = max(checkpoint.progress, computed)

    def end_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The checkpoint is saved (or failed): requests waiting for it may go."""
        checkpoint.done = True
        if self._checkpoints.pop(checkpoint.id, None) is not None:
            log.debug("checkpoint %d ended at %d tokens", checkpoint.id, checkpoint.progress)
        for held in self._held.values():
            if held.checkpoint is checkpoint:
                held.checkpoint = None
                held.priority = held.own
        released = [waiter for waiter in self._waiters.values() if waiter.blocked_on is checkpoint]
        for waiter in released:
            waiter.blocked_on = None
        self._dispatch()
        # An urgent waiter that found no free slot takes one, as it would have on arrival.
        for waiter in released:
            if waiter.lease is None and waiter.ticket.id in self._waiters:
                self._make_room(waiter.ticket)

    def best_source(self, tokens: Tokens) -> tuple[str, int, tuple[tuple[str, str], ...]] | None:
        """What cached sequence shares the most with ``tokens``: a description, the shared
        length and that sequence's prompt sections; None when nothing is cached."""
        candidates = [
            (
                f"slot {row.slot} (agent {row.agent})",
                common_prefix(tokens, row.tokens),
                row.sections,
            )
            for row in self._slots.table()
            if row.tokens
        ]
        found = self.store.best(tokens) if self.store is not None else None
        if found is not None:  # after the slots: the first of equals is named
            entry, shared = found
            candidates.append((f"stored {entry.kind.value} {entry.id}", shared, entry.sections))
        return max(candidates, key=lambda candidate: candidate[1], default=None)

    def available(self, tokens: Tokens) -> int:
        """Tokens of ``tokens`` that could be had now without computing them."""
        best = self.best_source(tokens)
        return 0 if best is None else best[1]

    def _worth_waiting_for(self, tokens: Tokens) -> Checkpoint | None:
        """The checkpoint this request should wait for, if waiting is estimated to be sooner."""
        if not tokens or not self._checkpoints or self.store is None:
            return None
        available = self.available(tokens)
        costs = self.costs
        # Computing alone would run next to the prompts being computed now (the checkpoint's at
        # least), which share the engine: each goes about that many times slower.
        decoding = {r.lease.slot for r in self._declared() if r.decoding}
        contention = 1 + sum(
            1 for row in self._slots.table() if row.held and row.slot not in decoding
        )

        def gain(checkpoint: Checkpoint) -> float:
            shared = common_prefix(tokens, checkpoint.tokens)
            if shared < available + self.config.share_min:
                return 0.0
            remaining = costs.prefill.estimate(
                checkpoint.progress, len(checkpoint.tokens) - checkpoint.progress
            )
            wait = remaining + costs.restore.estimate(costs.state_bytes(len(checkpoint.tokens)))
            return contention * costs.prefill.estimate(available, shared - available) - wait

        best = max(self._checkpoints.values(), key=gain)
        return best if gain(best) > 0 else None

    # -- a pool of engines ----------------------------------------------------------------------

    def wake(self) -> None:
        """Slots came back into placement without a lease ending (a pool's engine rejoined):
        hand them out to whoever waits."""
        self._dispatch()

    # -- watchdog -------------------------------------------------------------------------------

    def sweep(self) -> list[Lease]:
        """The watchdog's work: reclaim leases held past their TTL, then dispatch."""
        reclaimed = self._slots.sweep(self.clock())
        for lease in reclaimed:
            self._end(lease.id)
            log.warning(
                "watchdog reclaimed lease %d on slot %d (agent %s), held since %.1f",
                lease.id,
                lease.slot,
                lease.agent,
                lease.acquired_at,
            )
        if reclaimed:
            self._dispatch()
        return reclaimed

    async def run_watchdog(self, interval: float) -> None:
        """Sweep forever, every ``interval`` seconds. Run it in the runtime's task group."""
        while True:
            await anyio.sleep(interval)
            self.sweep()

    # -- the operator's view --------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (not background work)."""
        return len(self._scheduler)

    def snapshot(self) -> DispatcherSnapshot:
        """Slots, queue, checkpoints and counters, as typed rows (with no place in the agent
        tree: :meth:`agentkv.runtime.tree.AgentTree.annotate` adds it)."""
        now = self.clock()
        running = {r.lease.slot: r for r in self._declared()}
        return DispatcherSnapshot(
            slots=tuple(
                SlotRow(
                    slot=row.slot,
                    agent=row.agent,
                    tokens=len(row.tokens),
                    stored=row.stored,
                    busy=row.held,
                    state=self._state(row, running),
                    priority=running[row.slot].priority if row.slot in running else None,
                    idle_s=(
                        None if row.last_used is None or row.held else round(now - row.last_used, 3)
                    ),
                    leases=row.lease_ids,
                    parent=None,
                    description=None,
                )
                for row in self._slots.table()
            ),
            queue=tuple(
                QueueRow(
                    ticket=ticket.id,
                    agent=ticket.agent,
                    priority=ticket.priority,
                    tokens=len(ticket.tokens),
                    waited_s=round(now - ticket.arrival, 3),
                    score=round(score, 3),
                    waiting_for_checkpoint=self._blocked_id(ticket),
                    parent=None,
                    description=None,
                )
                for ticket, score in self._scheduler.queued(now)
            ),
            background=tuple(
                BackgroundRow(ticket=t.id, agent=t.agent, waited_s=round(now - t.arrival, 3))
                for t, _ in self._background.queued(now)
            ),
            checkpoints=tuple(
                CheckpointRow(
                    id=c.id,
                    agent=c.agent,
                    slot=c.slot,
                    tokens=len(c.tokens),
                    progress=c.progress,
                    running_s=round(now - c.started, 3),
                )
                for c in self._checkpoints.values()
            ),
            placements=self._slots.stats().view(),
        )

    def _state(self, row: SlotView, running: dict[int, _Held]) -> SlotState:
        if not row.held:
            return "out" if self._slots.is_out(row.slot) else "idle"
        if row.slot in running and running[row.slot].decoding:
            return "decoding"
        return "prefilling"

    def _blocked_id(self, ticket: Ticket) -> int | None:
        waiter = self._waiters.get(ticket.id)
        return None if waiter is None or waiter.blocked_on is None else waiter.blocked_on.id

    # -- dispatch -------------------------------------------------------------------------------

    def _ready(self, ticket: Ticket) -> bool:
        waiter = self._waiters.get(ticket.id)
        if waiter is None or waiter.blocked_on is not None:
            return False
        now = self.clock()
        since = self._quiet_since.get((ticket.agent, ticket.arrival), ticket.arrival)
        if (
            self._yields(ticket.priority)
            and ticket.priority - self._scheduler.aging * (now - since) > 0
            and self._urgent_running()
        ):
            # Quiet while urgent: only a ticket with (nearly) nothing to compute may start.
            placement = self._place(ticket)
            return placement is not None and len(ticket.tokens) - placement.reuse <= self.quiet_min
        return True

    def _first_token_due(self, ticket: Ticket) -> bool:
        """Wait for another request's first token rather than share the batch that computes its
        last prompt tokens: prefill is priced per token, additively, so one after the other gives
        that request its first token sooner and this one its own no later. Never for a more
        urgent ticket. Dispatch stops at this ticket until that first token
        (:meth:`note_decoding`), which keeps the queue's order and its starvation bound."""
        batch = self.config.engine_batch
        short_prefill_runs = any(
            not held.decoding
            and held.ticket.priority <= ticket.priority
            and len(held.ticket.tokens) - held.lease.placement.reuse <= batch
            for held in self._held.values()
        )
        if not short_prefill_runs:
            return False  # the common case: no placement to price
        placement = self._place(ticket)
        return placement is not None and len(ticket.tokens) - placement.reuse <= batch

    def _hits(self, ticket: Ticket) -> bool:
        placement = self._place(ticket)
        return placement is not None and placement.reuse > 0

    def _place(self, ticket: Ticket) -> Placement | None:
        return self._slots.place(
            ticket.tokens,
            self.costs,
            store=self.store,
            park_min=self.config.park_min,
            keep=self.warm() if self.warm is not None else frozenset(),
        )

    def _dispatch_reserved(self, ticket_id: int) -> None:
        """A slot given back by a request suspended for ``ticket_id``: that ticket takes it (if
        it still waits and may go), ahead of older less urgent tickets that aging ranks first."""
        waiter = self._waiters.get(ticket_id)
        if (
            waiter is None
            or not waiter.waiting
            or not self._slots.free
            or not self._ready(waiter.ticket)
            or self._first_token_due(waiter.ticket)
        ):
            return
        ticket = self._scheduler.cancel(ticket_id)
        if ticket is None:
            return
        if not self._grant(waiter, ticket, self.clock()):
            self._scheduler.submit(ticket, ticket.arrival)

    def _grant(
        self, waiter: _Waiter, ticket: Ticket, now: float, *, background: bool = False
    ) -> bool:
        """Lease ``ticket`` the slot placement chooses; False when no slot is free."""
        placement = self._place(ticket)
        if placement is None:
            return False
        lease = self._slots.acquire(placement, now, agent=ticket.agent, tokens=ticket.tokens)
        held = _Held(
            lease,
            ticket,
            next(self._dispatched),
            pinned=self._pin_entry(lease),
            background=background,
        )
        self._held[lease.id] = held
        waiter.lease = lease
        self._quiet_since.pop((ticket.agent, ticket.arrival), None)
        log.debug(
            "lease %d: ticket %d (agent %s, priority %d, waited %.1f s) on slot %d, %s, "
            "reuses %d of %d tokens",
            lease.id,
            ticket.id,
            ticket.agent,
            ticket.priority,
            now - ticket.arrival,
            lease.slot,
            placement.source.value,
            placement.reuse,
            len(ticket.tokens),
        )
        self._plan_checkpoint(held)
        waiter.event.set()
        return True

    def _dispatch(self) -> None:
        now = self.clock()
        while self._slots.free and (len(self._scheduler) or len(self._background)):
            queue = self._scheduler if len(self._scheduler) else self._background
            ticket = queue.pop(now, hits=self._hits, ready=self._ready)
            if ticket is None:
                # Every foreground ticket waits for a checkpoint; background work waits too.
                return
            waiter = self._waiters.get(ticket.id)
            if waiter is None:  # withdrawn between submit and now; nothing holds it
                continue
            if queue is self._scheduler:
                # A checkpoint planned earlier in this same pass may be worth waiting for.
                self._block(waiter)
                if waiter.blocked_on is not None:
                    queue.submit(ticket, ticket.arrival)
                    continue
            if self._first_token_due(ticket):
                queue.submit(ticket, ticket.arrival)  # its turn comes with that first token
                return
            background = queue is self._background
            if not self._grant(waiter, ticket, now, background=background):  # free > 0: granted
                queue.submit(ticket, ticket.arrival)
                return

    def _pin_entry(self, lease: Lease) -> tuple[StoreIndex, str] | None:
        """Keep the entry ``lease`` was placed to restore until the lease ends: another slot's
        save before the restore (the request may park first) could supersede it, and the restore
        would find nothing."""
        entry_id = lease.placement.entry_id
        index = self.store
        if index is not None and lease.placement.source is Source.STORE and entry_id:
            index.pin(entry_id)
            return (index, entry_id)
        return None

    def _withdraw(self, waiter: _Waiter) -> None:
        self._waiters.pop(waiter.ticket.id, None)
        if waiter.lease is not None:  # woken, but the caller went away before using it
            # Nothing ran on the slot: it still holds what it held before.
            self.release(waiter.lease, holds=waiter.lease.evicted)
            return
        self._scheduler.cancel(waiter.ticket.id)
        self._background.cancel(waiter.ticket.id)
        self._quiet_since.pop((waiter.ticket.agent, waiter.ticket.arrival), None)
