"""Workloads built from a real Claude Code request.

The template is the first request of a fresh ``claude -p`` session (Claude Code 2.1.328, shipped
as package data): system blocks, 12 tools, then a user turn of two ``<system-reminder>`` blocks
and the user's words, then the ~9 KB environment note as a ``system`` message. A fresh session of
another agent in the same project is that request with other user words and another session id;
a follow-up turn appends a scripted assistant tool call and its result, as Claude Code does.

``scale`` below 1 shortens the long texts (system prompt, tool descriptions, environment note)
and keeps fewer tools, so that the same shape fits a CI run on two cores.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from importlib import resources
from typing import Any

import attrs

from agentkv_bench.workload import WORDS, Agent, Workload

__all__ = [
    "ClaudeSpec",
    "PrioritySpec",
    "build_claude_workload",
    "build_priority_workload",
    "claude_template",
    "follow_up",
    "fresh_request",
    "new_agent_workload",
    "shrink",
]

#: The user's words in the captured requests; every fresh session replaces them.
_CAPTURED_WORDS = "Reply with the single word: alpha"


def _captured(name: str) -> dict[str, Any]:
    """A capture shipped as package data (a new copy on every call)."""
    text = resources.files("agentkv_bench").joinpath("data", name).read_text("utf-8")
    captured: dict[str, Any] = json.loads(text)
    return captured


def claude_template() -> dict[str, Any]:
    """The captured first request of a fresh Claude Code session (a new copy on every call)."""
    body: dict[str, Any] = _captured("claude_code_first_request.json")["body"]
    return body


def _cut(text: str, scale: float) -> str:
    return text if scale >= 1 else text[: max(40, int(len(text) * scale))]


def _fewer_tools(tools: list[Any], scale: float) -> list[Any]:
    return tools[: max(1, math.ceil(len(tools) * scale))]


def shrink(body: dict[str, Any], scale: float) -> dict[str, Any]:
    """``body`` with its long texts cut to ``scale`` of their length and fewer tools (the
    structure, the order of the parts and the user's words are kept)."""
    out = copy.deepcopy(body)
    if scale >= 1:
        return out
    for block in out.get("system", [])[1:]:
        block["text"] = _cut(block["text"], scale)
    out["tools"] = _fewer_tools(out.get("tools", []), scale)
    for tool in out["tools"]:
        tool["description"] = _cut(tool.get("description", ""), scale)
    for message in out["messages"]:
        if message["role"] == "system":
            for block in message["content"]:
                block["text"] = _cut(block["text"], scale)
    return out


def _session_id(agent: int, session: int, salt: str) -> str:
    return f"{salt:0>8.8}-{agent:04x}-4000-8000-{session:012x}"


def fresh_request(
    template: dict[str, Any],
    *,
    words: str,
    session_id: str,
    max_tokens: int,
    captured: str = _CAPTURED_WORDS,
) -> dict[str, Any]:
    """The first request of a fresh session: ``template`` (whose first user turn ends with the
    ``captured`` words) with these user words and session id.

    ``max_tokens`` bounds the reply (Claude Code asks for 128000; a one-word answer needs a few),
    and ``temperature`` 0 makes every configuration generate the same reply for the same prompt.
    """
    body = copy.deepcopy(template)
    first = body["messages"][0]["content"]
    if first[-1].get("text") != captured:
        raise ValueError("the template's first user turn does not end with the captured words")
    first[-1]["text"] = words
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        user = json.loads(metadata["user_id"])
        user["session_id"] = session_id
        metadata["user_id"] = json.dumps(user, separators=(",", ":"))
    body.update(max_tokens=max_tokens, temperature=0.0, stream=True)
    return body


def follow_up(body: dict[str, Any], turn: int) -> dict[str, Any]:
    """The next request of the session: the assistant called Bash, and here is its result."""
    out = copy.deepcopy(body)
    call_id = f"toolu_bench{turn:04d}"
    out["messages"].append(
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look at the project first."},
                {
                    "type": "tool_use",
                    "id": call_id,
                    "name": "Bash",
                    "input": {"command": "ls -la", "description": "List the project files"},
                },
            ],
        }
    )
    listing = "\n".join(
        f"-rw-r--r-- 1 dev dev {120 + 37 * i:>5} Nov 30 09:{i:02d} file{turn}_{i}.txt"
        for i in range(6)
    )
    out["messages"].append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call_id, "content": listing}],
        }
    )
    return out


@attrs.frozen
class ClaudeSpec:
    """``agents`` agents on ``slots`` slots; each runs ``sessions`` fresh sessions one after
    another, each of ``1 + followups`` requests. All agents start at once."""

    agents: int = 3
    slots: int = 2
    sessions: int = 2
    followups: int = 0
    max_tokens: int = 16
    scale: float = 1.0
    #: Index of the first user word (another run can use words no earlier run used).
    first_word: int = 0

    @classmethod
    def quick(cls) -> ClaudeSpec:
        """A CI-sized version: the same shape with texts cut to an eighth (~1,800 tokens)."""
        return cls(agents=3, slots=2, sessions=2, followups=1, scale=0.125)


def _words(index: int) -> str:
    word = WORDS[index % len(WORDS)] + ("" if index < len(WORDS) else str(index // len(WORDS)))
    return f"Reply with the single word: {word}"


def _sessions(
    template: dict[str, Any], spec: ClaudeSpec, agent: int, salt: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    for session in range(spec.sessions):
        body = fresh_request(
            template,
            words=_words(spec.first_word + agent * spec.sessions + session),
            session_id=_session_id(agent, session, salt),
            max_tokens=spec.max_tokens,
        )
        yield session, body
        for turn in range(spec.followups):
            body = follow_up(body, turn)
            yield session, body


def build_claude_workload(spec: ClaudeSpec, *, salt: str = "bench") -> Workload:
    """Agents ``agent-0`` … that start at once; P1 and P2 alternate."""
    template = shrink(claude_template(), spec.scale)
    agents = []
    for index in range(spec.agents):
        pairs = list(_sessions(template, spec, index, salt))
        agents.append(
            Agent(
                name=f"agent-{index}",
                priority=1 + index % 2,
                requests=tuple(body for _, body in pairs),
                sessions=tuple(session for session, _ in pairs),
            )
        )
    return Workload(agents=tuple(agents))


def new_agent_workload(spec: ClaudeSpec, *, name: str = "newcomer") -> Workload:
    """One agent with one fresh session, whose words no agent of ``spec`` used."""
    single = attrs.evolve(
        spec,
        agents=1,
        sessions=1,
        followups=0,
        first_word=spec.first_word + spec.agents * spec.sessions,
    )
    workload = build_claude_workload(single, salt="new")
    agent = attrs.evolve(workload.agents[0], name=name)
    return Workload(agents=(agent,))


# -- priority ------------------------------------------------------------------------------------


@attrs.frozen
class PrioritySpec:
    """A P0 coordinator and ``subagents`` sub-agents (P1, P2, …) on ``slots`` slots.

    The coordinator's first turn runs alone (warm-up). Then, ``rounds`` times: the sub-agents
    start fresh Claude-Code-sized prompts (each with its own system prompt, so nothing of it is
    cached anywhere) and, ``delay`` seconds later, while they are prefilling, the coordinator
    sends its next turn.
    """

    slots: int = 2
    subagents: int = 2
    rounds: int = 3
    delay: float = 3.0
    max_tokens: int = 16
    scale: float = 1.0

    @classmethod
    def quick(cls) -> PrioritySpec:
        return cls(slots=2, subagents=2, rounds=2, delay=1.0, scale=0.125)


def _subagent_request(template: dict[str, Any], spec: PrioritySpec, rnd: int, j: int) -> Any:
    body = fresh_request(
        template,
        words=f"Task {rnd}.{j}: {_words(rnd * spec.subagents + j + 1)}",
        session_id=_session_id(100 + j, rnd, "sub"),
        max_tokens=spec.max_tokens,
    )
    # A sub-agent has its own instructions: its prompt differs from the start of the system text.
    body["system"][1]["text"] = (
        f"You are sub-agent {j} of round {rnd}. " + body["system"][1]["text"]
    )
    return body


def build_priority_workload(spec: PrioritySpec) -> tuple[Workload, list[Workload]]:
    """The warm-up (the coordinator's first turn) and one workload per round."""
    template = shrink(claude_template(), spec.scale)
    turn = fresh_request(
        template,
        words="You coordinate the sub-agents. Reply with the single word: ready",
        session_id=_session_id(0, 0, "coord"),
        max_tokens=spec.max_tokens,
    )
    warmup = Workload(agents=(Agent(name="coordinator", priority=0, requests=(turn,)),))
    rounds = []
    for rnd in range(spec.rounds):
        turn = follow_up(turn, rnd)
        subagents = [
            Agent(
                name=f"sub-{rnd}-{j}",
                priority=1 + j % 2,
                requests=(_subagent_request(template, spec, rnd, j),),
            )
            for j in range(spec.subagents)
        ]
        coordinator = Agent(name="coordinator", priority=0, requests=(turn,), start=spec.delay)
        rounds.append(Workload(agents=(*subagents, coordinator)))
    return warmup, rounds
