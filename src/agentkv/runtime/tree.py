"""The agent tree at run time: :class:`~agentkv.agents.AgentDirectory` decides (who is whose
sub-agent, who waits, what priority); this module wires it to the runtime: a request's agent and
priority before it is queued, the ``Agent`` calls of a reply when it ends, the queued tickets of
sub-agents whose priority changed, whose context to keep warm, and the operator's annotations.
With the tree off (``RuntimeConfig.agent_tree``) every request belongs to its root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from agentkv.agents import AGENT_TOOL, AgentCall, AgentDirectory, AgentPlace, AgentView
from agentkv.anthropic_sse import reply_message
from agentkv.reply import BlockOpened, ReplyEvent
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.runtime.prefetch import Prefetcher
from agentkv.runtime.record import RequestRecord
from agentkv.snapshot import QueueRow, SlotRow

__all__ = ["AgentTree"]

#: A row of the operator's view that names an agent: it shows the agent's place in the tree.
Placed = TypeVar("Placed", SlotRow, QueueRow)


@attrs.define(eq=False)
class AgentTree:
    """One runtime's agent tree; ``enabled`` False makes every sub-agent its root."""

    dispatcher: Dispatcher
    clock: Callable[[], float]
    enabled: bool = True
    background_offset: int = 1
    directory: AgentDirectory = attrs.field(init=False)
    #: Fan-out prefetch (given by the runtime when there is a store to save heads in).
    prefetcher: Prefetcher | None = None
    #: The last answer of :meth:`warm` and the directory version it was computed at: placement
    #: asks for every ticket it prices, and an empty answer changes only with the directory.
    _warm: tuple[int, frozenset[str]] = attrs.field(init=False, default=(-1, frozenset()))

    def __attrs_post_init__(self) -> None:
        self.directory = AgentDirectory(background_offset=self.background_offset)

    def place(
        self, root: str, sub: str | None, priority: int, body: Mapping[str, Any]
    ) -> AgentPlace:
        """The agent a request belongs to and the priority it runs at."""
        if not self.enabled:
            return AgentPlace(agent=root, priority=priority)
        now = self.clock()
        place = self.directory.request(root, sub, priority, body, now)
        self._reprioritise(place.agent, now)
        return place

    def replied(self, agent: str, events: Sequence[ReplyEvent]) -> list[AgentCall]:
        """A reply agentkv streamed to ``agent`` ended: learn the sub-agents it starts. Returns
        the ``Agent`` calls the reply ended its turn in (their sub-agents start now)."""
        if not self.enabled or not _calls_agent(events):
            return []
        try:
            message = reply_message(events)
        except Exception:  # a reply cut short: its calls are learnt from the next request
            return []
        now = self.clock()
        calls = self.directory.reply(
            agent,
            message.get("content"),
            ended_in_tools=message.get("stop_reason") == "tool_use",
            now=now,
        )
        self._reprioritise(agent, now)
        return calls

    def warm(self) -> frozenset[str]:
        """Agents waiting for their sub-agents: their slot content is parked, never just lost."""
        if not self.enabled:
            return frozenset()
        version, agents = self._warm
        if version != self.directory.version or agents:
            agents = self.directory.waiting_parents(self.clock())
            self._warm = (self.directory.version, agents)
        return agents

    def view(self) -> list[AgentView]:
        return self.directory.view(self.clock()) if self.enabled else []

    def ended(
        self, prepared: Any, events: Sequence[ReplyEvent], *, ok: bool, running: bool
    ) -> None:
        """A request of ``prepared.agent`` ended (``ok``: whole): learn the sub-agents its reply
        starts; while the runtime is ``running``, let the prefetcher learn from the request and
        prepare their heads."""
        calls = self.replied(prepared.agent, events) if ok else []
        if self.prefetcher is not None and running:
            place = self.describe(prepared.agent)
            self.prefetcher.finished(prepared, place, calls, ok=ok, priority=prepared.priority)

    def describe(self, agent: str) -> AgentPlace | None:
        """Where ``agent`` stands in the tree now (None: not known, or the tree is off)."""
        return self.directory.describe(agent) if self.enabled else None

    def label(self, record: RequestRecord) -> None:
        """A queued request's record: its parent, the description of its call and whether its
        parent waits for it, as they stand now."""
        place = self.describe(record.agent)
        if place is not None and place.parent is not None:
            record.label(place.parent, place.description, place.waited_on)

    def relabel(self, records: Iterable[RequestRecord]) -> None:
        """Records of sub-agents learn the description of their call, once it is known (whether
        the parent waited stays as it was when the request was queued)."""
        for record in records:
            if record.parent is not None and record.description is None:
                place = self.describe(record.agent)
                if place is not None:
                    record.learn_description(place.description)

    def annotate(self, rows: Sequence[Placed], tree: Sequence[AgentView]) -> tuple[Placed, ...]:
        """Slot or queue ``rows`` of the operator's view, each with its agent's place in
        ``tree`` (this tree's :meth:`view`): its parent and the description of its call."""
        places = {row.agent: {"parent": row.parent, "description": row.description} for row in tree}
        unknown = {"parent": None, "description": None}
        return tuple(attrs.evolve(item, **places.get(item.agent or "", unknown)) for item in rows)

    def _reprioritise(self, parent: str, now: float) -> None:
        """Queued requests of ``parent``'s sub-agents take their priority as inferred now."""
        for row in self.directory.view(now):
            if row.parent == parent:
                self.dispatcher.reprioritise(row.agent, row.priority)


def _calls_agent(events: Sequence[ReplyEvent]) -> bool:
    return any(isinstance(event, BlockOpened) and event.tool_name == AGENT_TOOL for event in events)
