"""One request's replayable event log and the clients that follow it.

The log belongs to the request, not to a connection: a client that attaches late (a retry that
joined it) gets everything emitted so far, then follows live. When the last client leaves before
the end, the log is *orphaned*; after ``grace`` seconds with nobody back it abandons its producer
(the request is cancelled).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import attrs

from agentkv.anthropic_sse import reply_message
from agentkv.exceptions import AgentKVError
from agentkv.reply import ReplyEvent

__all__ = ["Broadcast", "Emitted", "Event", "Failed", "KeepAlive"]


@attrs.frozen
class Emitted:
    """The reply's events, in order."""

    events: list[ReplyEvent]


@attrs.frozen
class KeepAlive:
    """Nothing happened for a while; a stream sends a ping."""


@attrs.frozen
class Failed:
    """The request ended with this error (after the events already emitted)."""

    error: AgentKVError


Event = Emitted | KeepAlive | Failed


@attrs.define(eq=False)
class Broadcast:
    """The events of one request, replayed to every follower; the only writer is its producer.

    ``abandon`` stops the producer; ``spawn`` runs the grace timer in the background, or says
    False when it cannot (the runtime is stopping, or none was given): an orphaned log then
    abandons at once.
    """

    abandon: Callable[[], None]
    #: Seconds an orphaned log waits for a follower before it abandons its producer.
    grace: float
    #: Seconds of silence after which a follower gets a ``KeepAlive``.
    ping_interval: float
    spawn: Callable[[Callable[[], Awaitable[None]]], bool] = lambda _: False
    clock: Callable[[], float] = time.monotonic
    _events: list[ReplyEvent] = attrs.field(init=False, factory=list)
    _changed: anyio.Event = attrs.field(init=False, factory=anyio.Event)
    _failure: AgentKVError | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    _followers: int = attrs.field(init=False, default=0)
    #: A follower read the log to its end.
    _delivered: bool = attrs.field(init=False, default=False)
    #: When the last follower left before the end (None: followed, or not yet orphaned).
    orphaned_at: float | None = attrs.field(init=False, default=None)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> AgentKVError | None:
        return self._failure

    @property
    def followers(self) -> int:
        return self._followers

    @property
    def delivered(self) -> bool:
        """A follower has read everything, the end included."""
        return self._delivered

    @property
    def unclaimed(self) -> bool:
        """Nobody follows it, nobody read it to the end, and it has not failed: a client's retry
        of the same request may take it over."""
        return self._followers == 0 and not self._delivered and self._failure is None

    @property
    def emitted(self) -> Sequence[ReplyEvent]:
        """Everything emitted so far (read-only)."""
        return tuple(self._events)

    def emit(self, events: list[ReplyEvent]) -> None:
        if events and not self._closed:
            self._events.extend(events)
            self._wake()

    def close(self, failure: AgentKVError | None = None) -> None:
        """The end: nothing more is emitted; ``failure`` is what ended it badly, if anything."""
        if self._closed:
            return
        self._failure = failure
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def follow(self, ping_interval: float | None = None) -> AsyncGenerator[Event, None]:
        """Everything emitted so far, then live events until the end; ``KeepAlive`` on silence.
        Leaving early detaches; the last follower to leave before the end orphans the log."""
        interval = self.ping_interval if ping_interval is None else ping_interval
        self._followers += 1
        self.orphaned_at = None
        sent = 0
        try:
            while True:
                if sent < len(self._events):
                    batch = self._events[sent:]
                    sent = len(self._events)
                    yield Emitted(batch)
                    continue
                if self._closed:
                    if self._failure is not None:
                        yield Failed(self._failure)
                    self._delivered = True
                    return
                changed = self._changed
                with anyio.move_on_after(interval) as idle:
                    await changed.wait()
                if idle.cancelled_caught:
                    yield KeepAlive()
        finally:
            self._followers -= 1
            if self._followers == 0 and not self._closed:
                self._orphaned()

    async def message(self) -> dict[str, Any]:
        """The whole reply as one Anthropic Message; raises the error that ended it."""
        events: list[ReplyEvent] = []
        async with contextlib.aclosing(self.follow(ping_interval=3600)) as items:
            async for item in items:
                if isinstance(item, Emitted):
                    events.extend(item.events)
                elif isinstance(item, Failed):
                    raise item.error
        return reply_message(events)

    def _orphaned(self) -> None:
        self.orphaned_at = self.clock()
        if not self.spawn(self._abandon_unless_followed):
            self.abandon()

    async def _abandon_unless_followed(self) -> None:
        await anyio.sleep(self.grace)
        if not self._closed and self._followers == 0:
            self.abandon()
