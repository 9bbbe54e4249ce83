"""Fan-out prefetch: when a reply ends in ``Agent`` calls, start on the sub-agents' head at once.

Sub-agents of one type in one tree share a head (their system prompt, tools and the session
context: :mod:`agentkv.agents`). When a reply ends its turn in ``Agent`` calls, :class:`Prefetcher`
queues again, for each call's ``subagent_type``, the first request of that type seen in the tree,
at the parent's priority and generating one token, unless its head is cached already: the head is
computed and saved as a checkpoint, and the sub-agents' requests wait for it and restore it.
Nothing is predicted for a tree's first fan-out of a type, for a ``fork``, or without a store.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from cachetools import LRUCache

from agentkv.agents import SEPARATOR, AgentCall, AgentPlace
from agentkv.tokens import Tokens

#: A prepared request (:class:`agentkv.runtime.lifecycle.Prepared`, which imports this module):
#: its ``agent``, ``priority``, ``engine``, ``tokens``, ``boundary`` and ``key``.
Prepared = Any

__all__ = ["PREFETCH_AGENT", "Prefetcher"]

log = logging.getLogger("agentkv.prefetch")

#: The name under a parent that a prefetch request runs as (``<parent>/prefetch``).
PREFETCH_AGENT = "prefetch"
_FORK = "fork"


@attrs.define(eq=False)
class Prefetcher:
    """Remembers each tree's sub-agent heads; prepares them when a fan-out starts.

    ``submit`` queues a prepared request (the runtime's), ``available`` says how many of a
    prompt's tokens a slot or the store holds now, ``split_min`` is the least head worth
    computing on its own.
    """

    submit: Callable[[Prepared], Any]
    available: Callable[[Tokens], int]
    split_min: int
    #: Heads remembered, least recently seen dropped first.
    max_heads: int = 64
    #: Agents whose first request was seen (only a first request starts with the bare head).
    max_agents: int = 1024
    _heads: LRUCache[tuple[str, str], Prepared] = attrs.field(
        init=False, default=attrs.Factory(lambda self: LRUCache(self.max_heads), takes_self=True)
    )
    _seen: LRUCache[str, None] = attrs.field(
        init=False, default=attrs.Factory(lambda self: LRUCache(self.max_agents), takes_self=True)
    )
    _inflight: dict[tuple[str, str], Any] = attrs.field(init=False, factory=dict)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))

    def finished(
        self,
        prepared: Prepared,
        place: AgentPlace | None,
        calls: Sequence[AgentCall],
        *,
        ok: bool,
        priority: int,
    ) -> list[Prepared]:
        """A request ended (``ok`` or not), its reply's turn ending in ``calls``: learn a
        sub-agent's head from it (its first request, ended well), and prepare the heads of its
        fan-out."""
        first = prepared.agent not in self._seen
        self._seen[prepared.agent] = None
        kind = place.subagent_type if place is not None else None
        if (
            first
            and ok
            and place is not None
            and place.parent is not None
            and place.root is not None
            and kind not in (None, _FORK)
            and prepared.boundary is not None
            and prepared.boundary >= self.split_min
        ):
            self._heads[(place.root, kind)] = prepared
        if not calls:
            return []
        root = place.root if place is not None and place.root else prepared.agent
        return self.fan_out(prepared.agent, root, calls, priority)

    def fan_out(
        self, parent: str, root: str, calls: Sequence[AgentCall], priority: int
    ) -> list[Prepared]:
        """``parent``'s reply ended in ``calls``: queue each head seen before that is not
        cached now, at ``priority``. Returns what was queued."""
        queued: list[Prepared] = []
        for kind in dict.fromkeys(call.subagent_type for call in calls):
            if kind is None or kind == _FORK:
                continue
            key = (root, kind)
            seen = self._heads.get(key)
            running = self._inflight.get(key)
            if seen is None or (running is not None and not getattr(running, "done", True)):
                continue
            head = seen.boundary
            assert head is not None
            if head - self.available(seen.tokens[:head]) < self.split_min:
                continue  # cached: its sub-agents restore it on arrival
            engine = attrs.evolve(seen.engine, body={**seen.engine.body, "max_tokens": 1})
            prepared = attrs.evolve(
                seen,
                agent=f"{parent}{SEPARATOR}{PREFETCH_AGENT}",
                priority=priority,
                engine=engine,
                key=f"prefetch:{next(self._ids)}",
            )
            log.info(
                "prefetch: %d-token head of %s sub-agents for %s, at priority %d",
                head,
                kind,
                parent,
                priority,
            )
            self._inflight[key] = self.submit(prepared)
            queued.append(prepared)
        return queued
