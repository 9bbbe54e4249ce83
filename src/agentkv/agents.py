"""Agents as a tree: a session's coordinator and the sub-agents it starts, with inferred priority.

Claude Code runs its sub-agents (the ``Agent`` tool) inside the coordinator's process: their
requests carry the coordinator's session id and custom headers, plus ``x-claude-code-agent-id``,
one per sub-agent. :class:`AgentDirectory` turns that into a tree. An agent is its root (the
session, or ``X-Agent-Id``) plus, where present, the sub-agent id; a sub-agent's parent is the
agent whose ``Agent`` call started it.

**Linking.** A sub-agent's first user message ends with the ``prompt`` of the call that started it.
The directory learns calls from the replies agentkv streamed (:meth:`AgentDirectory.reply`) and
from the assistant turns of an agent's later requests; a request's tool results that name a
sub-agent (``agentId: …``, ``tasks/….output``) link that call exactly. From the call it keeps
the ``description``, the ``subagent_type`` and ``run_in_background``.

**Priority.** A sub-agent its parent is blocked on runs at the parent's priority: the call said
``run_in_background: false``, or the parent's turn ended in that call and it has sent nothing
since. Any other sub-agent (a background one) runs ``background_offset`` levels less urgent. A
sub-agent not linked yet counts as waited on while its parent has sent nothing since the
sub-agent appeared. An agent's own requests always carry its own priority.

Pure: values in, values out, time passed in. Memory is bounded: at most ``max_agents`` agents
(the least recently seen are forgotten first), each remembering at most ``max_calls`` calls, and
an agent idle for ``idle_ttl`` seconds is forgotten.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from agentkv.scheduler import MAX_PRIORITY

__all__ = [
    "AGENT_TOOL",
    "AgentCall",
    "AgentDirectory",
    "AgentPlace",
    "AgentView",
    "agent_calls",
    "agent_name",
    "first_prompt",
    "named_subagents",
]

#: The name of Claude Code's tool that starts a sub-agent.
AGENT_TOOL: Final = "Agent"
#: What separates a root from a sub-agent id in an agent's name.
SEPARATOR: Final = "/"
#: How Claude Code's tool results name the sub-agent a call started: ``agentId: a0d8…`` for a
#: foreground one, ``…/tasks/a496….output`` for a background one.
_NAMED = re.compile(r"agentId: ([0-9a-f]{8,32})\b|/tasks/([0-9a-f]{8,32})\.output\b")
#: Characters of a prompt or a description kept (they are shown and compared, never stored whole).
_MAX_TEXT = 4096
_MAX_LABEL = 200


def agent_name(root: str, sub: str | None) -> str:
    """The name of an agent: its root, and ``root/sub`` for a sub-agent."""
    return root if sub is None else f"{root}{SEPARATOR}{sub}"


@attrs.frozen
class AgentCall:
    """One ``Agent`` tool call: what started a sub-agent."""

    id: str
    prompt: str
    description: str | None = None
    subagent_type: str | None = None
    #: ``run_in_background`` as the call gave it; None when it was not given (Claude Code's
    #: default is the background).
    background: bool | None = None

    @property
    def waited_on(self) -> bool:
        """The caller said it waits for the result (``run_in_background: false``)."""
        return self.background is False


def _text(value: object, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def _call(block: Mapping[str, Any]) -> AgentCall | None:
    if block.get("type") != "tool_use" or block.get("name") != AGENT_TOOL:
        return None
    args = block.get("input")
    call_id = block.get("id")
    if not isinstance(args, Mapping) or not isinstance(call_id, str):
        return None
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    background = args.get("run_in_background")
    return AgentCall(
        id=call_id[:128],
        # The end of a long prompt is what a sub-agent's message ends with.
        prompt=prompt.strip()[-_MAX_TEXT:],
        description=_text(args.get("description"), _MAX_LABEL),
        subagent_type=_text(args.get("subagent_type"), _MAX_LABEL),
        background=background if isinstance(background, bool) else None,
    )


def agent_calls(content: object) -> list[AgentCall]:
    """The ``Agent`` calls among a message's content blocks (a reply's, or an assistant turn's)."""
    if not isinstance(content, list):
        return []
    return [call for block in content if isinstance(block, Mapping) and (call := _call(block))]


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def named_subagents(body: Mapping[str, Any]) -> dict[str, str]:
    """Call id → sub-agent id, from tool results that name the sub-agent a call started."""
    named: dict[str, str] = {}
    for message in _messages(body):
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for block in content:
            if not isinstance(block, Mapping) or block.get("type") != "tool_result":
                continue
            call_id = block.get("tool_use_id")
            found = _NAMED.search(_result_text(block.get("content"))[: _MAX_TEXT * 4])
            if isinstance(call_id, str) and found:
                named[call_id] = found.group(1) or found.group(2)
    return named


def _result_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            block["text"]
            for block in content
            if isinstance(block, Mapping) and isinstance(block.get("text"), str)
        )
    return ""


def first_prompt(body: Mapping[str, Any]) -> str | None:
    """The text a sub-agent's first user message ends with (its last text block), or None."""
    first = next((m for m in _messages(body) if m.get("role") == "user"), None)
    content = None if first is None else first.get("content")
    if isinstance(content, list):
        texts = [
            block["text"]
            for block in content
            if isinstance(block, Mapping)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
        ]
        content = texts[-1] if texts else None
    return (content.strip()[-_MAX_TEXT * 2 :] or None) if isinstance(content, str) else None


@attrs.frozen
class AgentPlace:
    """Where a request sits in the tree and the priority it runs at: the directory's decision."""

    agent: str
    priority: int
    parent: str | None = None
    #: The sub-agent's parent waits for it (its result is the parent's next step).
    waited_on: bool = False
    description: str | None = None
    #: The tree's root (the session or ``X-Agent-Id``) and the ``subagent_type`` of the call that
    #: started the sub-agent, where known.
    root: str | None = None
    subagent_type: str | None = None


@attrs.frozen
class AgentView:
    """A read-only row of the agent tree, for the slot table, the page and ``status``."""

    agent: str
    root: str
    parent: str | None
    depth: int
    #: The priority the agent's requests run at now (its own for a root).
    priority: int
    description: str | None
    subagent_type: str | None
    background: bool | None
    waited_on: bool
    #: Sub-agents of this agent that are still active (seen after its last request).
    waiting_for: int
    requests: int
    idle_s: float


@attrs.define
class _Agent:
    name: str
    root: str
    sub: str | None
    priority: int
    first_seen: float
    #: Both start at ``first_seen``.
    last_seen: float = attrs.Factory(lambda self: self.first_seen, takes_self=True)
    last_request: float = attrs.Factory(lambda self: self.first_seen, takes_self=True)
    requests: int = 0
    parent: str | None = None
    call: AgentCall | None = None
    #: An unlinked sub-agent's first prompt, kept until a call matches it.
    pending_prompt: str | None = None
    #: Calls this agent made, oldest first (call id → call), and which sub-agent took each.
    calls: OrderedDict[str, AgentCall] = attrs.Factory(OrderedDict)
    taken: dict[str, str] = attrs.Factory(dict)
    #: When this agent's last reply ended its turn in ``Agent`` calls, and their ids.
    turn_ended: float | None = None
    turn_calls: frozenset[str] = frozenset()


@attrs.define(kw_only=True)
class AgentDirectory:
    """The agents seen lately, as trees; see the module docs for the rules."""

    background_offset: int = attrs.field(
        default=1, validator=attrs.validators.in_(range(MAX_PRIORITY + 1))
    )
    max_agents: int = attrs.field(default=1024, validator=attrs.validators.gt(0))
    max_calls: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    idle_ttl: float = attrs.field(default=6 * 3600.0, validator=attrs.validators.gt(0))
    #: A parent counts as waiting only while a sub-agent it waits for was active this recently
    #: (an abandoned fan-out stops holding its slot warm).
    wait_ttl: float = attrs.field(default=900.0, validator=attrs.validators.gt(0))
    _agents: OrderedDict[str, _Agent] = attrs.field(init=False, factory=OrderedDict)
    #: Counts the changes (requests, replies): a caller may keep an answer while it is unchanged.
    version: int = attrs.field(init=False, default=0)

    # -- what happens ---------------------------------------------------------------------------

    def request(
        self,
        root: str,
        sub: str | None,
        priority: int,
        body: Mapping[str, Any],
        now: float,
    ) -> AgentPlace:
        """A request arrives: place it in the tree and say what priority it runs at.

        ``priority`` is the request's own (``X-Agent-Priority`` or the default): a root runs at it;
        a sub-agent at its parent's, or less urgent when its parent does not wait for it.
        """
        self._expire(now)
        self.version += 1
        if sub is not None and root not in self._agents:
            # A sub-agent whose coordinator agentkv has not seen (its requests went elsewhere,
            # or were forgotten): the coordinator stands in the tree, silent since.
            self._agents[root] = _Agent(root, root, None, priority, now, last_request=-math.inf)
        name = agent_name(root, sub)
        agent = self._agents.get(name)
        if agent is None:
            agent = _Agent(name=name, root=root, sub=sub, priority=priority, first_seen=now)
            if sub is not None:
                agent.parent = root
                agent.pending_prompt = first_prompt(body)
            self._agents[name] = agent
        self._agents.move_to_end(name)
        agent.last_seen = now
        agent.last_request = now
        agent.requests += 1
        agent.turn_ended = None
        if sub is None:
            agent.priority = priority
        # The Agent calls in the request's assistant turns (the caller's own earlier replies).
        turns = [m.get("content") for m in _messages(body) if m.get("role") == "assistant"]
        self._learn_calls(agent, (call for content in turns for call in agent_calls(content)))
        for call_id, sub_id in named_subagents(body).items():
            self._link_named(agent, call_id, sub_id)
        if agent.call is None and agent.pending_prompt is not None:
            self._link_by_prompt(agent)
        if sub is not None:
            agent.priority = self._inferred(agent)
        self._trim()
        return self._place(agent)

    def reply(
        self, agent: str, content: object, *, ended_in_tools: bool, now: float
    ) -> list[AgentCall]:
        """``agent``'s reply streamed by agentkv: learn its ``Agent`` calls; when the reply
        ended the turn in them (``stop_reason: tool_use``), the agent now waits for them, and
        they are returned (the sub-agents about to start)."""
        node = self._agents.get(agent)
        if node is None:
            return []
        self.version += 1
        node.last_seen = now
        self._agents.move_to_end(agent)
        calls = agent_calls(content)
        if not calls:
            return []
        self._learn_calls(node, calls)
        if ended_in_tools:
            node.turn_ended = now
            node.turn_calls = frozenset(call.id for call in calls)
        # A sub-agent that came first (its request raced the reply's end) may link now.
        for other in list(self._agents.values()):
            if other.root == node.root and other.call is None and other.pending_prompt:
                self._link_by_prompt(other)
        return calls if ended_in_tools else []

    def describe(self, agent: str) -> AgentPlace | None:
        """Where ``agent`` stands now: its parent, whether that waits for it, its priority and the
        description of the call that started it; None for an agent not known."""
        node = self._agents.get(agent)
        return None if node is None else self._place(node)

    def waiting_parents(self, now: float) -> frozenset[str]:
        """Agents that wait for sub-agents now: their context is worth keeping warm."""
        self._expire(now)
        counts = self._waiting_counts(now)
        return frozenset(name for name, count in counts.items() if count > 0)

    def view(self, now: float) -> list[AgentView]:
        """The agents as trees: each root, then its sub-agents depth first, by first sight."""
        self._expire(now)
        children: dict[str | None, list[_Agent]] = {}
        for node in sorted(self._agents.values(), key=lambda n: (n.first_seen, n.name)):
            under = node.parent if node.parent in self._agents else None
            children.setdefault(under, []).append(node)
        waiting = self._waiting_counts(now)
        rows: list[AgentView] = []
        stack = [(node, 0) for node in reversed(children.get(None, []))]
        seen: set[str] = set()
        while stack:
            node, depth = stack.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            rows.append(
                AgentView(
                    **attrs.asdict(self._place(node)),
                    depth=depth,
                    background=node.call.background if node.call else None,
                    waiting_for=waiting.get(node.name, 0),
                    requests=node.requests,
                    idle_s=round(now - node.last_seen, 3),
                )
            )
            stack.extend((child, depth + 1) for child in reversed(children.get(node.name, [])))
        return rows

    def __len__(self) -> int:
        return len(self._agents)

    # -- the rules ------------------------------------------------------------------------------

    def _place(self, node: _Agent) -> AgentPlace:
        parent = self._agents.get(node.parent) if node.parent else None
        call = node.call
        return AgentPlace(
            agent=node.name,
            priority=self._inferred(node),
            parent=node.parent,
            waited_on=parent is not None and self._waited_on(node, parent),
            description=call.description if call else None,
            root=node.root,
            subagent_type=call.subagent_type if call else None,
        )

    def _inferred(self, node: _Agent) -> int:
        """The priority ``node`` runs at: a root's (it has no parent) is its own."""
        parent = self._agents.get(node.parent) if node.parent else None
        if parent is None:
            return node.priority
        # A sub-agent parent's priority is the one last inferred for it (no walk up the tree).
        if self._waited_on(node, parent):
            return parent.priority
        return min(MAX_PRIORITY, parent.priority + self.background_offset)

    def _waited_on(self, node: _Agent, parent: _Agent) -> bool:
        """Whether ``parent`` is blocked on ``node`` (see the module docs)."""
        call = node.call
        if call is not None and call.waited_on:
            return True
        silent = parent.last_request <= node.first_seen
        if call is None:
            return silent
        return (
            parent.turn_ended is not None
            and call.id in parent.turn_calls
            and parent.last_request <= parent.turn_ended
        )

    def _waiting_counts(self, now: float) -> dict[str, int]:
        """Per agent, the sub-agents it waits for now: those it is blocked on that were active
        since its last request (and within ``wait_ttl``), or, before any has come, the calls its
        turn ended in."""
        counts: dict[str, int] = {}
        recent = now - self.wait_ttl
        for node in self._agents.values():
            parent = self._agents.get(node.parent) if node.parent else None
            if (
                parent is not None
                and node.last_seen >= max(parent.last_request, recent)
                and self._waited_on(node, parent)
            ):
                counts[parent.name] = counts.get(parent.name, 0) + 1
        for node in self._agents.values():
            ended = node.turn_ended
            if ended is not None and node.last_request <= ended and ended >= recent:
                counts[node.name] = max(counts.get(node.name, 0), len(node.turn_calls))
        return counts

    # -- linking --------------------------------------------------------------------------------

    def _learn_calls(self, node: _Agent, calls: Iterable[AgentCall]) -> None:
        for call in calls:
            if call.id not in node.calls:
                node.calls[call.id] = call
        while len(node.calls) > self.max_calls:
            old, _ = node.calls.popitem(last=False)
            node.taken.pop(old, None)

    def _link(self, child: _Agent, parent: _Agent, call: AgentCall) -> None:
        previous = parent.taken.get(call.id)
        if previous is not None and previous != child.name:
            return  # another sub-agent took this call
        parent.taken[call.id] = child.name
        child.call = call
        child.parent = parent.name
        child.pending_prompt = None

    def _link_named(self, parent: _Agent, call_id: str, sub_id: str) -> None:
        call = parent.calls.get(call_id)
        child = self._agents.get(agent_name(parent.root, sub_id))
        if call is not None and child is not None and child.call is None:
            self._link(child, parent, call)

    def _link_by_prompt(self, child: _Agent) -> None:
        prompt = child.pending_prompt
        if not prompt:
            return
        for parent in self._candidates(child):
            for call in parent.calls.values():
                if call.id in parent.taken or not prompt.endswith(call.prompt):
                    continue
                self._link(child, parent, call)
                return

    def _candidates(self, child: _Agent) -> Sequence[_Agent]:
        """Agents of the child's tree that may have started it, the most recent first."""
        nodes = self._agents.values()
        found = [n for n in nodes if n.root == child.root and n.name != child.name and n.calls]
        return sorted(found, key=lambda node: node.last_seen, reverse=True)

    # -- bounds ---------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        while self._agents:
            name, oldest = next(iter(self._agents.items()))
            if now - oldest.last_seen < self.idle_ttl:
                break
            del self._agents[name]

    def _trim(self) -> None:
        while len(self._agents) > self.max_agents:
            self._agents.popitem(last=False)
