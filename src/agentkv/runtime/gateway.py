"""The scheduling layer at run time: tickets wait in the FairScheduler, slots come as leases.

The pure components decide; this module only waits and wakes. Dispatch is event-driven: it runs
whenever a ticket arrives or a lease comes back, so no loop polls the queue. Everything here runs on
one event loop, and the sections between awaits are atomic, so no lock is needed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs

from agentkv import FairScheduler, Fingerprint, Lease, MatchKind, SlotManager, Ticket

__all__ = ["Gateway", "RequestRecord"]

log = logging.getLogger("agentkv.server")


@attrs.define
class _Waiter:
    ticket: Ticket
    event: anyio.Event = attrs.field(factory=anyio.Event)
    lease: Lease | None = None


@attrs.define
class _Running:
    """A leased request that may still be pre-empted (it has produced no output yet)."""

    priority: int
    acquired_at: float
    preempt: Callable[[], None]


@attrs.define
class RequestRecord:
    """What the slot table shows about one finished (or running) request."""

    agent: str
    priority: int
    ticket: int = 0
    #: Order in which requests got their slot (1, 2, …): shows what the scheduler chose.
    dispatch_seq: int | None = None
    slot: int | None = None
    match: str | None = None
    queued_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    #: The reply tried a tool call that could not be recovered, and was asked for again.
    retried: bool = False
    #: Times this request gave its slot up, before producing anything, to a P0 request.
    preempted: int = 0
    status: str = "queued"


@attrs.define
class Gateway:
    """Owns the SlotManager and FairScheduler of one engine and hands out leases fairly."""

    n_slots: int
    aging: float = 0.1
    max_queue: int = 256
    lease_ttl: float = 900.0
    tie_window: float = 0.25
    #: A P0 request that finds every slot busy takes one from a running request of at least this
    #: priority that has not produced output yet (None: never pre-empt).
    preempt_from: int | None = None
    clock: Callable[[], float] = time.monotonic
    _slots: SlotManager = attrs.field(init=False)
    _scheduler: FairScheduler = attrs.field(init=False)
    #: Background work (compaction): dispatched only while no foreground ticket waits.
    _background: FairScheduler = attrs.field(init=False)
    _waiters: dict[int, _Waiter] = attrs.field(init=False, factory=dict)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _dispatched: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _lease_seq: dict[int, int] = attrs.field(init=False, factory=dict)
    _running: dict[int, _Running] = attrs.field(init=False, factory=dict)
    _recent: list[RequestRecord] = attrs.field(init=False, factory=list)
    _agents: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._slots = SlotManager(self.n_slots, lease_ttl=self.lease_ttl)
        self._scheduler = FairScheduler(
            aging=self.aging, max_queue=self.max_queue, tie_window=self.tie_window
        )
        self._background = FairScheduler(aging=self.aging, max_queue=self.max_queue)

    @property
    def slots(self) -> SlotManager:
        return self._slots

    @property
    def scheduler(self) -> FairScheduler:
        return self._scheduler

    def submit(
        self,
        agent: str,
        priority: int,
        fingerprint: Fingerprint | None,
        *,
        background: bool = False,
        arrival: float | None = None,
    ) -> Ticket:
        """Queue a ticket (QueueFullError at the cap); dispatch at once if a slot is free.

        A ``background`` ticket gets a slot only when no foreground ticket is waiting, whatever
        its score: compaction must never delay an agent's request. A request that gave its slot
        up to a P0 request comes back with its original ``arrival``, so it keeps its aging credit.
        """
        ticket = Ticket(
            id=next(self._ids),
            agent=agent,
            priority=priority,
            arrival=self.clock() if arrival is None else arrival,
            fingerprint=fingerprint,
        )
        (self._background if background else self._scheduler).submit(ticket, ticket.arrival)
        self._waiters[ticket.id] = _Waiter(ticket)
        self._dispatch()
        waiter = self._waiters[ticket.id]
        if priority == 0 and not background and waiter.lease is None:
            self._preempt_for(ticket)
        return ticket

    def running(self, lease: Lease, priority: int, preempt: Callable[[], None]) -> None:
        """Declare a leased request pre-emptible until :meth:`started` (or its release)."""
        self._running[lease.id] = _Running(priority, lease.acquired_at, preempt)

    def started(self, lease: Lease) -> None:
        """The request produced output: from now on it keeps its slot to the end."""
        self._running.pop(lease.id, None)

    def _preempt_for(self, ticket: Ticket) -> None:
        if self.preempt_from is None:
            return
        victims = [
            (running.priority, running.acquired_at, lease_id)
            for lease_id, running in self._running.items()
            if running.priority >= max(self.preempt_from, ticket.priority + 1)
        ]
        if not victims:
            return
        # The least urgent, and among those the one that started last (least work lost).
        _, _, lease_id = max(victims)
        victim = self._running.pop(lease_id)
        log.info(
            "pre-empting lease %d (priority %d) for ticket %d", lease_id, victim.priority, ticket.id
        )
        victim.preempt()

    async def wait(self, ticket: Ticket) -> Lease:
        """Wait for the ticket's lease. Cancellation withdraws the ticket or returns the lease."""
        waiter = self._waiters.get(ticket.id)
        if waiter is None:
            raise RuntimeError(f"ticket {ticket.id} is not known to this gateway")
        try:
            await waiter.event.wait()
        except BaseException:
            self._withdraw(waiter)  # synchronous: cancellation cannot interrupt it
            raise
        del self._waiters[ticket.id]
        assert waiter.lease is not None
        return waiter.lease

    def release(
        self, lease: Lease, fingerprint: Fingerprint | None = None, *, ok: bool = True
    ) -> None:
        """Return a lease. After a failure the slot's cache is in an unknown state: forget it."""
        now = self.clock()
        self._lease_seq.pop(lease.id, None)
        self._running.pop(lease.id, None)
        if self._slots.release(lease, now, fingerprint=fingerprint) and not ok:
            self._slots.invalidate(lease.slot)
        self._dispatch()

    def dispatch_seq(self, lease: Lease) -> int | None:
        """The order in which this lease was handed out (1, 2, …), while it is held."""
        return self._lease_seq.get(lease.id)

    @asynccontextmanager
    async def hold(self, ticket: Ticket) -> AsyncIterator[Lease]:
        """``async with gateway.hold(ticket) as lease``: wait for the lease and always release it.

        Release is synchronous, so it happens on normal exit, on error, on client disconnect and on
        cancellation alike. Only a clean exit records the request's prefix as the slot's cache.
        """
        lease = await self.wait(ticket)
        ok = False
        try:
            yield lease
            ok = True
        finally:
            # Synchronous, so no cancellation can cut it short, whatever ended the block.
            self.release(lease, ticket.fingerprint if ok else None, ok=ok)

    def sweep(self) -> list[Lease]:
        """The watchdog's work: reclaim leases held past their TTL, then dispatch."""
        reclaimed = self._slots.sweep(self.clock())
        for lease in reclaimed:
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
        """Sweep forever, every ``interval`` seconds. Run it in the server's task group."""
        while True:
            await anyio.sleep(interval)
            self.sweep()

    def record(self, record: RequestRecord) -> None:
        """Keep the last requests for the slot table."""
        self._recent.append(record)
        del self._recent[:-64]
        agent = self._agents.setdefault(
            record.agent, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        )
        agent["requests"] += 1
        agent["prompt_tokens"] += record.prompt_tokens
        agent["cached_tokens"] += record.cached_tokens
        agent["priority"] = record.priority

    def table(self) -> dict[str, Any]:
        """The operator's view: slots, queue, hit counters, recent requests."""
        now = self.clock()
        stats = self._slots.stats()
        engine_prompt = sum(r.prompt_tokens for r in self._recent)
        engine_cached = sum(r.cached_tokens for r in self._recent)
        return {
            "slots": [
                {
                    "slot": row.slot,
                    "fingerprint": row.fingerprint.short if row.fingerprint else None,
                    "prefix_blocks": len(row.fingerprint.blocks) if row.fingerprint else 0,
                    "refcount": row.refcount,
                    "idle_s": None if row.last_used is None else round(now - row.last_used, 3),
                    "agent": row.agent,
                    "leases": list(row.lease_ids),
                }
                for row in self._slots.table()
            ],
            "queue": [
                {
                    "ticket": ticket.id,
                    "agent": ticket.agent,
                    "priority": ticket.priority,
                    "waited_s": round(now - ticket.arrival, 3),
                    "score": round(score, 3),
                }
                for ticket, score in self._scheduler.queued(now)
            ],
            "background": [
                {
                    "ticket": ticket.id,
                    "agent": ticket.agent,
                    "waited_s": round(now - ticket.arrival, 3),
                }
                for ticket, _ in self._background.queued(now)
            ],
            "hits": {
                "exact": stats.exact,
                "prefix": stats.prefix,
                "miss": stats.miss,
                "reclaimed": stats.reclaimed,
                "hit_rate": round(stats.hit_rate, 4),
                "recent_cached_token_ratio": (
                    round(engine_cached / (engine_cached + engine_prompt), 4)
                    if engine_cached + engine_prompt
                    else None
                ),
            },
            "agents": self._agents,
            "recent": [attrs.asdict(r) for r in self._recent[-16:]],
        }

    def _hits(self, ticket: Ticket) -> bool:
        match = self._slots.peek(ticket.fingerprint)
        return match is not None and match.kind is not MatchKind.MISS

    def _dispatch(self) -> None:
        now = self.clock()
        while self._slots.free and (len(self._scheduler) or len(self._background)):
            queue = self._scheduler if len(self._scheduler) else self._background
            ticket = queue.pop(now, hits=self._hits)
            if ticket is None:
                return
            waiter = self._waiters.get(ticket.id)
            if waiter is None:  # withdrawn between submit and now; nothing holds it
                continue
            waiting = [t.fingerprint for t, _ in self._scheduler.queued(now) if t.fingerprint]
            lease = self._slots.acquire(
                ticket.fingerprint, now, agent=ticket.agent, protect=waiting
            )
            if lease is None:  # cannot happen while free > 0; keep the ticket rather than lose it
                queue.submit(ticket, ticket.arrival)
                return
            waiter.lease = lease
            self._lease_seq[lease.id] = next(self._dispatched)
            waiter.event.set()

    def _withdraw(self, waiter: _Waiter) -> None:
        self._waiters.pop(waiter.ticket.id, None)
        if waiter.lease is not None:  # woken, but the caller went away before using it
            # Nothing ran, but the lease claims the request's prefix: forget rather than lie.
            self.release(waiter.lease, ok=False)
            return
        self._scheduler.cancel(waiter.ticket.id)
        self._background.cancel(waiter.ticket.id)
