"""Workloads of the benchmark: pure, seeded, and identical for every configuration.

The common shapes (:class:`Agent`, :class:`Workload`), the synthetic workload and the
unavoidable prefill of a request sequence (:func:`minimum_prefill`). In the synthetic workload
the agents share one system prompt and tool list, shaped like Claude Code's; turn ``t`` of an
agent holds its task plus ``t`` scripted rounds of a tool call and its result, so every
configuration sees byte-identical requests whatever the model answers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs

from agentkv.tokens import common_prefix as shared_prefix_len

__all__ = [
    "WORDS",
    "Agent",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "minimum_prefill",
    "shared_prefix_len",
]

# Code-ish words: tokenizers split them roughly like real source and prose about source.
_WORD_TEXT = (
    "agent buffer cache client config context decode engine error event file fingerprint "
    "gateway handler index json kernel lease limit loader message model module parse path "
    "prefill prompt queue reader record request response retry scheduler server session "
    "slot stream table task ticket token tool translate value worker async await return "
    "import class def self none true false list dict str int float bytes yield raise with "
    "for while if else try except finally lambda test assert fixture mock patch result"
)
_WORDS = tuple(_WORD_TEXT.split())

_TOOL_NAMES = ("Read", "Grep", "Edit", "Bash", "Glob", "Write", "TodoWrite", "WebFetch")


@attrs.frozen
class WorkloadSpec:
    """How big the workload is. Sizes are in words; roughly 1.3 tokens each for the default model.

    ``agents`` run on ``slots`` engine slots, ``turns`` requests each, closed loop. Agent 0 is the
    P0 coordinator; the others alternate between P1 and P2.
    """

    agents: int = 6
    slots: int = 2
    turns: int = 4
    system_words: int = 400
    tool_words: int = 30
    tools: int = 6
    task_words: int = 50
    result_words: int = 100
    reply_words: int = 20
    max_tokens: int = 24
    seed: int = 1

    @classmethod
    def quick(cls, seed: int = 1) -> WorkloadSpec:
        """A small version for CI: still more agents than slots, a few seconds per config."""
        return cls(
            agents=3,
            slots=2,
            turns=2,
            system_words=160,
            tool_words=16,
            tools=3,
            task_words=24,
            result_words=60,
            reply_words=10,
            max_tokens=12,
            seed=seed,
        )


@attrs.frozen
class Agent:
    """One simulated agent: its id (sent as ``X-Agent-Id``), priority and scripted requests,
    sent one after another from ``start`` seconds on. ``sessions``: each request's session
    (empty: one); ``api``: its route (:data:`agentkv_bench.drivers.ROUTES`); ``headers``, when
    given, are sent instead of ``X-Agent-Id``/``X-Agent-Priority`` (a client's own).
    """

    name: str
    priority: int
    requests: tuple[dict[str, Any], ...]
    start: float = 0.0
    sessions: tuple[int, ...] = ()
    api: str = "messages"
    headers: tuple[tuple[str, str], ...] = ()

    def session_of(self, index: int) -> int:
        return self.sessions[index] if self.sessions else 0


@attrs.frozen
class Workload:
    """The agents and their requests; ``canonical_order()`` lists requests turn by turn."""

    agents: tuple[Agent, ...]

    def canonical_order(self) -> list[tuple[str, int, dict[str, Any]]]:
        """Every request as ``(agent, turn, body)``: all agents' turn 0, then turn 1, …"""
        longest = max((len(agent.requests) for agent in self.agents), default=0)
        return [
            (agent.name, turn, agent.requests[turn])
            for turn in range(longest)
            for agent in self.agents
            if turn < len(agent.requests)
        ]

    @property
    def n_requests(self) -> int:
        return sum(len(agent.requests) for agent in self.agents)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) + ("." if i % 12 == 11 else "") for i in range(words))


def _code(rng: random.Random, words: int) -> str:
    """Tool output that looks like source: short lines with line numbers."""
    lines: list[str] = []
    left = words
    n = rng.randrange(1, 400)
    while left > 0:
        take = min(left, rng.randrange(3, 9))
        lines.append(f"{n:>5}\t" + " ".join(rng.choice(_WORDS) for _ in range(take)))
        left -= take
        n += 1
    return "\n".join(lines)


def _tools(rng: random.Random, spec: WorkloadSpec) -> list[dict[str, Any]]:
    tools = []
    for i in range(spec.tools):
        name = _TOOL_NAMES[i % len(_TOOL_NAMES)] + ("" if i < len(_TOOL_NAMES) else str(i))
        tools.append(
            {
                "name": name,
                "description": _text(rng, spec.tool_words),
                "input_schema": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": _text(rng, 6)},
                        "pattern": {"type": "string", "description": _text(rng, 6)},
                        "limit": {"type": "integer", "description": _text(rng, 4)},
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
            }
        )
    return tools


def _agent_requests(
    rng: random.Random,
    spec: WorkloadSpec,
    index: int,
    system: list[dict[str, Any]],
    tools: list[dict[str, Any]],
) -> tuple[dict[str, Any], ...]:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Task {index}: " + _text(rng, spec.task_words)}
    ]
    requests = []
    for turn in range(spec.turns):
        requests.append(
            {
                "model": "bench",
                "max_tokens": spec.max_tokens,
                "stream": True,
                "temperature": 0.0,
                "system": system,
                "tools": tools,
                "messages": [dict(m) for m in messages],
            }
        )
        call_id = f"toolu_{index:02d}{turn:02d}{rng.randrange(16**8):08x}"
        tool = tools[rng.randrange(len(tools))]["name"]
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": _text(rng, spec.reply_words)},
                    {
                        "type": "tool_use",
                        "id": call_id,
                        "name": tool,
                        "input": {"path": f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"},
                    },
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call_id,
                        "content": _code(rng, spec.result_words),
                    },
                    {"type": "text", "text": "Answer in one short sentence."},
                ],
            }
        )
    return tuple(requests)


def build_workload(spec: WorkloadSpec) -> Workload:
    """The workload for ``spec``; the same spec (seed included) always gives the same requests."""
    rng = random.Random(spec.seed)
    system: list[dict[str, Any]] = [
        {"type": "text", "text": "You are a coding agent working in a shared repository."},
        {
            "type": "text",
            "text": _text(rng, spec.system_words),
            "cache_control": {"type": "ephemeral"},
        },
    ]
    tools = _tools(rng, spec)
    agents = []
    for index in range(spec.agents):
        # Each agent draws from its own stream, so adding agents does not change the others.
        agent_rng = random.Random(f"{spec.seed}:{index}")
        priority = 0 if index == 0 else 1 + (index - 1) % 2
        name = "coordinator" if index == 0 else f"worker-{index}"
        agents.append(
            Agent(
                name=name,
                priority=priority,
                requests=_agent_requests(agent_rng, spec, index, system, tools),
            )
        )
    return Workload(agents=tuple(agents))


#: Distinct one-word answers: the user's words of each fresh Claude-Code-shaped session.
_ALPHABET = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
)
WORDS = tuple(_ALPHABET.split())


def minimum_prefill(sequences: Sequence[Sequence[int]]) -> int:
    """The prefill no cache can avoid: each sequence minus its longest prefix shared with any
    earlier one (the shared system prompt counts once, each agent's own tokens once)."""
    total = 0
    for i, tokens in enumerate(sequences):
        shared = max((shared_prefix_len(tokens, earlier) for earlier in sequences[:i]), default=0)
        total += len(tokens) - shared
    return total
