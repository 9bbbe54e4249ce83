"""Fair dispatch order for requests waiting for a slot: priority with aging.

Each waiting ticket has the score ``priority - aging * (now - arrival)``; the lowest score runs
first, ties go to the earlier arrival, then the lower id (FIFO). Priority 0 is most urgent,
3 is background work such as compaction. Waiting lowers the score, so nothing starves.

Cache affinity may bend the order a little: when a ``hits`` predicate is given to :meth:`pop`,
any ticket whose score is within ``tie_window`` of the best one and for which ``hits`` is true
(its prefix is cached in an idle slot) goes first; among those the lowest score wins.

Starvation bound. Write α = aging, w = tie_window. If ticket U is dispatched while ticket T is
queued, then ``arrival(U) - arrival(T) <= (priority(T) - priority(U) + w) / α`` (w = 0 without
``hits``). Proof: U was picked at some time ``now``, so ``score(U) <= best + w <= score(T) + w``;
expanding the scores, ``p_U - α(now - a_U) <= p_T - α(now - a_T) + w``, and the ``now`` terms
cancel, giving ``α(a_U - a_T) <= p_T - p_U + w``. Hence a ticket T of priority p is dispatched
before every ticket arriving more than ``(p + w) / α`` seconds after it (p_U >= 0). With a queue
cap Q, T waits for at most Q - 1 tickets already queued plus those arriving within that window.
With the defaults (α = 0.1, w = 0.25) no ticket arriving more than 32.5 s after a background
ticket (p = 3) is dispatched before it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs

from agentkv._types import Ticket
from agentkv.exceptions import QueueFullError

__all__ = [
    "DEFAULT_AGING",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_TIE_WINDOW",
    "MAX_PRIORITY",
    "FairScheduler",
]

MAX_PRIORITY = 3  # priorities are 0 (most urgent) .. 3 (background)
#: The defaults, here once (the runtime's settings take them from here).
DEFAULT_AGING = 0.1
DEFAULT_MAX_QUEUE = 256
DEFAULT_TIE_WINDOW = 0.25


@attrs.define(eq=False, kw_only=True)
class FairScheduler:
    """A capped queue of tickets, popped by aged priority; see the module docs for the bound."""

    aging: float = attrs.field(default=DEFAULT_AGING, validator=attrs.validators.gt(0))
    max_queue: int = attrs.field(default=DEFAULT_MAX_QUEUE, validator=attrs.validators.gt(0))
    tie_window: float = attrs.field(default=DEFAULT_TIE_WINDOW, validator=attrs.validators.ge(0))
    _queue: dict[int, Ticket] = attrs.field(init=False, factory=dict)

    def submit(self, ticket: Ticket, now: float) -> None:
        """Queue ``ticket``; its ``arrival`` (not ``now``) is what aging counts from.

        Raises QueueFullError at the cap, ValueError for a priority outside 0..3 or a ticket id
        that is already queued.
        """
        if not 0 <= ticket.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be 0..{MAX_PRIORITY}, got {ticket.priority}")
        if ticket.id in self._queue:
            raise ValueError(f"ticket {ticket.id} is already queued")
        if len(self._queue) >= self.max_queue:
            raise QueueFullError(f"queue is full: {len(self._queue)} requests waiting; retry later")
        self._queue[ticket.id] = ticket

    def cancel(self, ticket_id: int) -> Ticket | None:
        """Remove a queued ticket and return it; None if it is not queued."""
        return self._queue.pop(ticket_id, None)

    def score(self, ticket: Ticket, now: float) -> float:
        """``priority - aging * (now - arrival)``: lower runs sooner."""
        return ticket.priority - self.aging * (now - ticket.arrival)

    def _key(self, ticket: Ticket, now: float) -> tuple[float, float, int]:
        return (self.score(ticket, now), ticket.arrival, ticket.id)

    def pop(
        self,
        now: float,
        *,
        hits: Callable[[Ticket], bool] | None = None,
        ready: Callable[[Ticket], bool] | None = None,
    ) -> Ticket | None:
        """Remove and return the ticket to dispatch now; None when no ticket can go.

        ``ready(ticket)`` False keeps a ticket waiting whatever its score (it waits for a prefix
        that another request is computing; that computation ends, so the wait is bounded).
        ``hits(ticket)`` (called only for ready tickets within ``tie_window`` of the best score)
        says whether the ticket's prefix is cached in an idle slot; such tickets win near-ties.
        """
        candidates = [t for t in self._queue.values() if ready is None or ready(t)]
        if not candidates:
            return None
        key = functools.partial(self._key, now=now)
        chosen = min(candidates, key=key)
        if hits is not None:
            limit = self.score(chosen, now) + self.tie_window
            near = sorted((t for t in candidates if self.score(t, now) <= limit), key=key)
            chosen = next((ticket for ticket in near if hits(ticket)), chosen)
        del self._queue[chosen.id]
        return chosen

    def queued(self, now: float) -> list[tuple[Ticket, float]]:
        """The queue in dispatch order (ignoring cache affinity), each with its score at ``now``."""
        ordered = sorted(self._queue.values(), key=functools.partial(self._key, now=now))
        return [(ticket, self.score(ticket, now)) for ticket in ordered]

    def __len__(self) -> int:
        return len(self._queue)
