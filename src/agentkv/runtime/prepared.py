"""Claude Code's compaction request, generated in idle time and served when it comes as predicted.

When a Claude Code agent's reply ends its turn past the compaction point, its next request is
known (:mod:`agentkv.forecast`): the previous request, the reply and the instruction. The runtime
then prepares that request and queues it as background work (the dispatcher's background lane,
priority 3: it gets a slot only while no agent request waits, and gives its slot up to one that
finds none free). Each agent's next request decides:

- the same request key (the same engine request: :func:`agentkv.runtime.admission.request_key`):
  the client gets the prepared exchange, finished (served whole) or still running (it joins:
  everything generated so far at once, then live), and it runs at the client's priority from then;
- another request: a miss. The prepared exchange is cancelled if it still runs, and the tokens it
  generated are counted as wasted (``not_compaction``: the agent sent no compaction; ``differs``:
  a compaction request, not the predicted one).

A prepared reply waits for its client ``wait`` seconds at most, one per agent, ``max_agents`` at
once (the oldest dropped first). :class:`Preparations` owns all of it; the runtime tells it when
a request is submitted and when an exchange ends.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
from cachetools import TTLCache

from agentkv.anthropic_sse import reply_message
from agentkv.exceptions import AgentKVError
from agentkv.forecast import CompactionForecast, is_claude_code
from agentkv.reply import ReplyEvent
from agentkv.runtime.admission import Prepared

__all__ = ["MISS_REASONS", "PREPARED_PRIORITY", "Preparations", "PreparedStats"]

log = logging.getLogger("agentkv.prepared")

#: The priority a prepared compaction runs at until its client claims it.
PREPARED_PRIORITY = 3
#: Why a prepared reply was not served: the agent's next request was no compaction, or another
#: compaction than predicted; it waited too long; it gave its slot to an agent's request and
#: could not be suspended; the engine failed it; a newer preparation for the agent replaced it.
MISS_REASONS = ("not_compaction", "differs", "expired", "gave_way", "failed", "replaced")
#: Agents with a prepared reply waiting at once, at most.
MAX_WAITING = 64


class _Record(Protocol):
    @property
    def output_tokens(self) -> int: ...
    @property
    def generated(self) -> int: ...


class _Exchange(Protocol):
    """What this module reads of :class:`agentkv.runtime.lifecycle.Exchange`."""

    @property
    def prepared(self) -> Prepared: ...
    @property
    def record(self) -> _Record: ...
    @property
    def done(self) -> bool: ...
    @property
    def joinable(self) -> bool: ...
    @property
    def gave_way(self) -> bool: ...
    @property
    def emitted(self) -> tuple[ReplyEvent, ...]: ...
    def cancel(self) -> None: ...
    def claim(self, priority: int) -> None: ...


E = TypeVar("E", bound=_Exchange)


def _generated(exchange: _Exchange) -> int:
    """Tokens ``exchange`` generated: as the engine reported them at the end, or, for a reply
    stopped before its end, its output chunks (about one token each)."""
    record = exchange.record
    return max(record.output_tokens, record.generated)


@attrs.frozen
class PreparedStats:
    """Counters since the start: compactions prepared, served finished, joined while running,
    missed (by reason), and the tokens generated for replies never served."""

    prepared: int = 0
    served: int = 0
    joined: int = 0
    missed: Mapping[str, int] = attrs.field(factory=dict)
    wasted_tokens: int = 0
    #: Prepared replies waiting for their client now.
    waiting: int = 0


class _Waiting(TTLCache[str, E]):
    """The prepared exchanges by agent: dropped after ``ttl`` seconds or when ``maxsize`` newer
    ones came, each drop told to ``dropped`` (cachetools drops them silently otherwise)."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        timer: Callable[[], float],
        dropped: Callable[[E, str], None],
    ) -> None:
        super().__init__(maxsize=maxsize, ttl=ttl, timer=timer)
        self._dropped = dropped

    def expire(self, time: float | None = None) -> list[tuple[str, E]]:
        expired = list(super().expire(time))
        for _, exchange in expired:
            self._dropped(exchange, "expired")
        return expired

    def popitem(self) -> tuple[str, E]:
        agent, exchange = super().popitem()
        self._dropped(exchange, "expired")
        return agent, exchange


@attrs.define(eq=False)
class Preparations(Generic[E]):
    """The prepared compactions of one runtime: what is waiting, for whom, and what came of it.

    ``prepare`` validates and fits a body (the runtime's :meth:`prepare`), ``start`` queues a
    prepared request as background work and returns its exchange, ``later`` runs work in the
    runtime's task group. ``window`` is Claude Code's context window (the slot's context);
    without it nothing is predicted.
    """

    prepare: Callable[[Mapping[str, Any], str, int], Awaitable[Prepared]]
    start: Callable[[Prepared], E]
    later: Callable[..., bool]
    window: int | None
    enabled: bool = True
    wait: float = 1800.0
    clock: Callable[[], float] = time.monotonic
    max_waiting: int = MAX_WAITING
    _forecast: CompactionForecast = attrs.field(init=False, factory=CompactionForecast)
    _waiting: _Waiting[E] = attrs.field(init=False)
    #: Agents whose preparation is being fitted (before its exchange exists): a token each.
    _pending: dict[str, object] = attrs.field(init=False, factory=dict)
    #: Exchanges cancelled on a miss that have not ended yet: their waste is counted at the end.
    _cancelled: set[E] = attrs.field(init=False, factory=set)
    _prepared: int = attrs.field(init=False, default=0)
    _served: int = attrs.field(init=False, default=0)
    _joined: int = attrs.field(init=False, default=0)
    _missed: Counter[str] = attrs.field(init=False, factory=Counter)
    _wasted: int = attrs.field(init=False, default=0)

    @_waiting.default
    def _cache(self) -> _Waiting[E]:
        return _Waiting(self.max_waiting, self.wait, self.clock, self._drop)

    @property
    def active(self) -> bool:
        return self.enabled and self.window is not None

    # -- the runtime tells it -------------------------------------------------------------------

    def claim(self, prepared: Prepared, *, retry: bool = False) -> E | None:
        """The agent's next request, ``prepared``, is being submitted: the prepared exchange when
        it is exactly that request (the client's from now on), else None. Any other request of
        the agent is a miss, unless it is a ``retry`` that joins a request still running."""
        body = prepared.body
        if body is not None:
            self._forecast = self._forecast.learn(body)
        agent = prepared.agent
        self._pending.pop(agent, None)  # it came before its preparation was queued
        self._waiting.expire()
        exchange = self._waiting.get(agent)
        if exchange is None:
            return None
        if exchange.prepared.key == prepared.key:
            if not exchange.joinable:
                return None  # being stopped (it gave its slot up): its end counts it
            del self._waiting[agent]
            served = exchange.done
            exchange.claim(prepared.priority)
            if served:
                self._served += 1
            else:
                self._joined += 1
            log.info(
                "agent %s sent the compaction request prepared for it; %s",
                agent,
                "served" if served else "joined while it runs",
            )
            return exchange
        if retry:
            return None
        compaction = body is not None and self._forecast.is_compaction(body)
        del self._waiting[agent]
        self._drop(exchange, "differs" if compaction else "not_compaction")
        return None

    def ended(self, exchange: E, *, ok: bool, running: bool) -> None:
        """An exchange ended: a preparation's end is counted; any other that ended well may
        predict its agent's compaction, which is then prepared."""
        if exchange in self._cancelled:
            self._cancelled.discard(exchange)
            self._wasted += _generated(exchange)
            return
        agent = exchange.prepared.agent
        if self._waiting.get(agent) is exchange:
            if not ok:  # it gave its slot up, or failed: it will never be served
                del self._waiting[agent]
                self._drop(exchange, "gave_way" if exchange.gave_way else "failed")
            return
        if ok and running and self.active:
            self._predict(exchange)

    # -- preparing --------------------------------------------------------------------------------

    def _predict(self, exchange: E) -> None:
        body, window = exchange.prepared.body, self.window
        if body is None or window is None or not is_claude_code(body):
            return
        try:
            reply = reply_message(exchange.emitted)
        except AgentKVError:
            return
        predicted = self._forecast.predict(body, reply, window)
        if predicted is None:
            return
        agent = exchange.prepared.agent
        token = object()
        self._pending[agent] = token
        if not self.later(self._prepare, agent, predicted, token):
            self._pending.pop(agent, None)

    async def _prepare(self, agent: str, body: Mapping[str, Any], token: object) -> None:
        # A task of the runtime's own: whatever goes wrong here must not stop the runtime.
        try:
            prepared = await self.prepare(body, agent, PREPARED_PRIORITY)
            if self._pending.get(agent) is not token:
                return  # the agent's next request came first
            exchange = self.start(prepared)
        except AgentKVError as exc:  # too long for the slot, the background queue is full…
            log.info("agent %s: its compaction request is not prepared: %s", agent, exc.message)
            return
        except Exception:
            log.exception("agent %s: preparing its compaction request failed", agent)
            return
        finally:
            if self._pending.get(agent) is token:
                del self._pending[agent]
        self._waiting.expire()
        previous = self._waiting.pop(agent, None)
        if previous is not None:
            self._drop(previous, "replaced")
        self._waiting[agent] = exchange
        self._prepared += 1
        log.info(
            "agent %s passed its compaction point: its compaction request (%d tokens) is prepared "
            "in idle time",
            agent,
            len(prepared.tokens),
        )

    def _drop(self, exchange: E, reason: str) -> None:
        """A prepared exchange will not be served: counted as a miss, stopped if it runs, and
        what it generated counted as wasted (at its end, when it still runs)."""
        self._missed[reason] += 1
        log.info("prepared compaction of agent %s not used (%s)", exchange.prepared.agent, reason)
        if exchange.done:
            self._wasted += _generated(exchange)
        else:
            self._cancelled.add(exchange)
            exchange.cancel()

    # -- what it holds ----------------------------------------------------------------------------

    def running(self) -> list[E]:
        """The prepared exchanges that have not ended."""
        self._waiting.expire()
        return [exchange for exchange in self._waiting.values() if not exchange.done]

    def stats(self) -> PreparedStats:
        self._waiting.expire()
        return PreparedStats(
            prepared=self._prepared,
            served=self._served,
            joined=self._joined,
            missed={reason: self._missed[reason] for reason in MISS_REASONS},
            wasted_tokens=self._wasted,
            waiting=len(self._waiting),
        )
