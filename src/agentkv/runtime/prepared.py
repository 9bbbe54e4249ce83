"""Claude Code's compaction request, generated in idle time and served when it comes as predicted.

When a Claude Code agent's turn ends past the compaction point, its next request is known
(:mod:`agentkv.forecast`) and is prepared as background work (priority 3: a slot only while no
agent request waits). The agent's next request with the same request key
(:func:`agentkv.runtime.admission.request_key`) gets the prepared exchange, finished or joined while
it runs, at the client's priority; any other request is a miss, and the tokens generated are
counted as wasted (``not_compaction``: the agent sent no compaction; ``differs``: a compaction
request, not the predicted one). A compaction reply without ``<summary>`` has its retry prepared
behind it, so that the agent's next two requests are served in turn; one with its summary has the
conversation after it computed in idle time, up to the user's next words
(:meth:`~agentkv.forecast.CompactionForecast.predict_after`). Prepared replies wait ``wait``
seconds at most, one chain per agent, ``max_waiting`` agents at once (the oldest dropped first).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
from cachetools import LRUCache, TTLCache

from agentkv.anthropic_sse import reply_message
from agentkv.exceptions import AgentKVError
from agentkv.forecast import (
    COMPACTION_ENDS,
    CompactionForecast,
    how_after_differs,
    is_claude_code,
    reaches_point,
)
from agentkv.reply import Ended, ReplyEvent
from agentkv.runtime.admission import Prepared

__all__ = [
    "MISS_REASONS",
    "PREPARED_PRIORITY",
    "Preparations",
    "PreparedStats",
    "claude_config_dir",
]

log = logging.getLogger("agentkv.prepared")

#: The priority a prepared compaction runs at until its client claims it.
PREPARED_PRIORITY = 3
#: Why a prepared reply was not served: the agent's next request was no compaction, or another
#: compaction than predicted; it waited too long; it gave its slot to an agent's request and
#: could not be suspended; the engine failed it; a newer preparation for the agent replaced it.
MISS_REASONS = ("not_compaction", "differs", "expired", "gave_way", "failed", "replaced")
#: Agents with a prepared reply waiting at once, at most.
MAX_WAITING = 64


def claude_config_dir() -> str:
    """Where Claude Code on this machine keeps its transcripts: ``$CLAUDE_CONFIG_DIR``, else
    ``~/.claude`` (a client on another machine or account teaches its own with its first request
    after a compaction)."""
    return os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".claude")


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
    #: Conversations after a compaction computed in idle time (up to the user's next words).
    heads: int = 0
    #: Of those, the ones whose request came otherwise than predicted (computed again).
    heads_missed: int = 0


class _Waiting(TTLCache[str, tuple[E, ...]]):
    """The prepared exchanges by agent, in the order the agent is expected to send their
    requests: dropped after ``ttl`` seconds or when ``maxsize`` newer agents came, each drop told
    to ``dropped`` (cachetools drops them silently otherwise)."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        timer: Callable[[], float],
        dropped: Callable[[E, str], None],
    ) -> None:
        super().__init__(maxsize=maxsize, ttl=ttl, timer=timer)
        self._dropped = dropped

    def expire(self, time: float | None = None) -> list[tuple[str, tuple[E, ...]]]:
        return [self._expired(item) for item in super().expire(time)]

    def popitem(self) -> tuple[str, tuple[E, ...]]:
        return self._expired(super().popitem())

    def _expired(self, item: tuple[str, tuple[E, ...]]) -> tuple[str, tuple[E, ...]]:
        for exchange in item[1]:
            self._dropped(exchange, "expired")
        return item


#: A cache by agent, as large as the agents waiting at once.
_per_agent: Any = attrs.Factory(lambda self: LRUCache(maxsize=self.max_waiting), takes_self=True)


@attrs.define(eq=False)
class Preparations(Generic[E]):
    """The prepared compactions of one runtime: what is waiting, for whom, and what came of it.

    ``prepare`` validates and fits a body (the runtime's :meth:`prepare`), ``start`` queues a
    prepared request as background work and returns its exchange (``head=True``: its shareable
    head computed and saved first), ``later`` runs work in the runtime's task group. ``window``
    is Claude Code's context window (the slot's context); without it nothing is predicted.
    ``config_dir`` is where Claude Code keeps its transcripts on this machine (``~/.claude``),
    until a client's own request names another.
    """

    prepare: Callable[[Mapping[str, Any], str, int], Awaitable[Prepared]]
    start: Callable[..., E]
    later: Callable[..., bool]
    window: int | None
    enabled: bool = True
    config_dir: str | None = None
    wait: float = 1800.0
    clock: Callable[[], float] = time.monotonic
    max_waiting: int = MAX_WAITING
    _forecast: CompactionForecast = attrs.field(init=False)
    _waiting: _Waiting[E] = attrs.field(init=False)
    #: Agents whose preparation is being fitted (before its exchange exists): a token each.
    _pending: dict[str, object] = attrs.field(init=False, factory=dict)
    #: Exchanges cancelled on a miss that have not ended yet: their waste is counted at the end.
    _cancelled: set[E] = attrs.field(init=False, factory=set)
    #: The counters of :class:`PreparedStats` but ``missed``, by field name.
    _counts: Counter[str] = attrs.field(init=False, factory=Counter)
    _missed: Counter[str] = attrs.field(init=False, factory=Counter)
    #: Conversations after a compaction being computed, by agent (stopped on a miss).
    _heads: LRUCache[str, E] = attrs.field(init=False, default=_per_agent)
    #: The conversation predicted after each agent's compaction: its next request is compared
    #: with it, and where it parts is logged.
    _after: LRUCache[str, Mapping[str, Any]] = attrs.field(init=False, default=_per_agent)
    #: The first reply of a compaction whose retry is prepared (used if the retry has no summary).
    _first_replies: LRUCache[str, Mapping[str, Any]] = attrs.field(init=False, default=_per_agent)

    @_forecast.default
    def _forecast_default(self) -> CompactionForecast:
        return CompactionForecast(config_dir=self.config_dir)

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
        head = self._heads.get(agent)
        if head is not None and head.done:
            del self._heads[agent]
        if body is not None and not retry and not self._forecast.is_compaction(body):
            self._compare_after(agent, body)
        self._waiting.expire()
        chain = self._waiting.get(agent)
        if not chain:
            return None
        exchange = chain[0]
        if exchange.prepared.key == prepared.key:
            if not exchange.joinable:
                return None  # being stopped (it gave its slot up): its end counts it
            self._keep(agent, chain[1:])
            served = exchange.done
            exchange.claim(prepared.priority)
            self._counts["served" if served else "joined"] += 1
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
        head = self._heads.pop(agent, None)
        if head is not None and not head.done:
            head.cancel()  # the conversation it computes will not come
        for missed in chain:
            self._drop(missed, "differs" if compaction else "not_compaction")
        return None

    def ended(self, exchange: E, *, ok: bool, running: bool) -> None:
        """An exchange ended: a preparation's end is counted; any other that ended well may
        predict its agent's compaction, which is then prepared."""
        if exchange in self._cancelled:
            self._cancelled.discard(exchange)
            self._counts["wasted_tokens"] += _generated(exchange)
            return
        agent = exchange.prepared.agent
        chain = self._waiting.get(agent, ())
        if exchange in chain:
            if not ok:  # it gave its slot up, or failed: it will never be served
                self._keep(agent, tuple(e for e in chain if e is not exchange))
                self._drop(exchange, "gave_way" if exchange.gave_way else "failed")
            elif running and self.active:
                self._predict(exchange, after=exchange)  # its retry waits behind it
            return
        if ok and running and self.active:
            self._predict(exchange)

    # -- preparing --------------------------------------------------------------------------------

    def _predict(self, exchange: E, after: E | None = None) -> None:
        """Prepare what ``exchange``'s reply makes known: the compaction after a turn, the retry
        after a compaction without a summary (queued behind ``after`` when it still waits)."""
        body, window = exchange.prepared.body, self.window
        if body is None or window is None or not is_claude_code(body):
            return
        forecast = self._forecast
        compaction = forecast.is_compaction(body)
        # Most replies lead to nothing: read the end before assembling the whole reply.
        ended = next((e for e in reversed(exchange.emitted) if isinstance(e, Ended)), None)
        # Claude Code reads a compaction reply however it ended; a turn's only when it ended.
        ends = COMPACTION_ENDS if compaction else ("end_turn",)
        if ended is None or ended.stop_reason not in ends:
            return
        usage = ended.usage
        context = usage.input_tokens + usage.cache_read_tokens + usage.output_tokens
        if not compaction and not reaches_point(body, context, window):
            return
        try:
            reply = reply_message(exchange.emitted)
        except AgentKVError:
            return
        agent = exchange.prepared.agent
        if compaction:
            predicted, what = forecast.predict_retry(body, reply), "compaction retry"
            if predicted is not None:
                self._first_replies[agent] = reply
            elif after is not None:
                head = forecast.predict_after(body, reply, self._first_replies.pop(agent, None))
                if head is not None:
                    self.later(self._compute_head, agent, head)
                return
        else:
            predicted = None if after is not None else forecast.predict(body, reply, window)
            what = "compaction request"
        if predicted is None:
            return
        token = object()
        self._pending[agent] = token
        if not self.later(self._prepare, agent, predicted, token, what, after):
            self._pending.pop(agent, None)

    async def _prepare(
        self, agent: str, body: Mapping[str, Any], token: object, what: str, after: E | None
    ) -> None:
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
        chain = self._waiting.pop(agent, ())
        if after is not None and after in chain:
            chain = (*chain, exchange)  # served after the one it follows
        else:
            for previous in chain:
                self._drop(previous, "replaced")
            chain = (exchange,)
        self._waiting[agent] = chain
        self._counts["prepared"] += 1
        log.info(
            "agent %s: its next %s (%d tokens) is prepared in idle time",
            agent,
            what,
            len(prepared.tokens),
        )

    def _compare_after(self, agent: str, body: Mapping[str, Any]) -> None:
        """The agent's first request after a compaction whose conversation was computed: where it
        parts from the prediction, if it does, is counted and logged."""
        predicted = self._after.pop(agent, None)
        if predicted is None:
            return
        differs = how_after_differs(predicted, body)
        if differs is None:
            return
        self._counts["heads_missed"] += 1
        log.info(
            "agent %s: the conversation after its compaction is not the one computed in idle "
            "time: %s",
            agent,
            differs,
        )

    async def _compute_head(self, agent: str, body: Mapping[str, Any]) -> None:
        """Compute the conversation that follows ``agent``'s prepared compaction, up to the
        user's next words, in idle time (one token generated, never served)."""
        running = self._heads.get(agent)
        if running is not None and not running.done:
            return  # one at a time per agent
        try:
            prepared = await self.prepare({**body, "max_tokens": 1}, agent, PREPARED_PRIORITY)
            self._heads[agent] = self.start(prepared, head=True)
        except AgentKVError as exc:
            log.info(
                "agent %s: the conversation after its compaction is not computed: %s",
                agent,
                exc.message,
            )
            return
        except Exception:
            log.exception("agent %s: computing the conversation after its compaction failed", agent)
            return
        self._counts["heads"] += 1
        self._after[agent] = body
        log.info(
            "agent %s: the conversation after its compaction (%d tokens before the user's next "
            "words) is computed in idle time",
            agent,
            prepared.boundary or len(prepared.tokens),
        )

    def _keep(self, agent: str, chain: tuple[E, ...]) -> None:
        """What still waits for ``agent``: ``chain``, or nothing when it is empty."""
        if chain:
            self._waiting[agent] = chain
        else:
            del self._waiting[agent]

    def _drop(self, exchange: E, reason: str) -> None:
        """A prepared exchange will not be served: counted as a miss, stopped if it runs, and
        what it generated counted as wasted (at its end, when it still runs)."""
        self._missed[reason] += 1
        log.info("prepared compaction of agent %s not used (%s)", exchange.prepared.agent, reason)
        if exchange.done:
            self._counts["wasted_tokens"] += _generated(exchange)
        else:
            self._cancelled.add(exchange)
            exchange.cancel()

    # -- what it holds ----------------------------------------------------------------------------

    def running(self) -> list[E]:
        """The prepared exchanges that have not ended."""
        self._waiting.expire()
        return [e for chain in self._waiting.values() for e in chain if not e.done]

    def stats(self) -> PreparedStats:
        self._waiting.expire()
        return PreparedStats(
            prepared=self._counts["prepared"],
            served=self._counts["served"],
            joined=self._counts["joined"],
            missed={reason: self._missed[reason] for reason in MISS_REASONS},
            wasted_tokens=self._counts["wasted_tokens"],
            waiting=sum(len(chain) for chain in self._waiting.values()),
            heads=self._counts["heads"],
            heads_missed=self._counts["heads_missed"],
        )
