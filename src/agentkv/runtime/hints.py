"""What agentkv knows about a request that an engine which places requests itself can use.

llama-server takes none of it: agentkv places and orders requests itself. vLLM, SGLang and
Dynamo schedule and route on their own, and each reads some of these facts from a field or a
header of its own (:mod:`agentkv.runtime.adapters`); agentkv hands every engine call the same
:class:`EngineHints`, and each adapter writes what its engine documents.
"""

from __future__ import annotations

import attrs

__all__ = ["LEAST_URGENT", "EngineHints"]

#: agentkv's priorities run from 0 (most urgent) to this (background work).
LEAST_URGENT = 3


def _priority(value: int) -> int:
    return min(max(int(value), 0), LEAST_URGENT)


@attrs.frozen
class EngineHints:
    """One request's agent, its place in the agent tree and its priority."""

    #: The agent, as the tree names it: a root (session or ``X-Agent-Id``), or
    #: ``<root>/<sub-agent id>`` for a sub-agent.
    agent: str
    #: agentkv's priority the request runs at: 0 most urgent … :data:`LEAST_URGENT` background.
    priority: int = attrs.field(converter=_priority)
    #: The agent that started this one (a sub-agent's coordinator), where known.
    parent: str | None = None

    @property
    def urgency(self) -> int:
        """The priority on a scale where a higher value is more urgent (0 … 3), for engines
        that order that way."""
        return LEAST_URGENT - self.priority
