"""The agent tree: sub-agents recognised, linked to the call that started them, prioritised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentkv.agents import (
    AgentCall,
    AgentDirectory,
    agent_calls,
    agent_name,
    first_prompt,
    named_subagents,
)

SUBAGENTS = Path(__file__).parent / "fixtures" / "claude_code" / "subagents"
ROOT = "coordinator"


def capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SUBAGENTS / name).read_text())
    return data


def sub_id(name: str) -> str:
    return str(capture(name)["headers"]["x-claude-code-agent-id"])


def call_block(call_id: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call_id,
        "name": "Agent",
        "input": {"prompt": prompt, "description": f"do {prompt}", **extra},
    }


def user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}


def test_captured_subagents_end_their_first_message_with_the_calls_prompt() -> None:
    """Claude Code's sub-agent request ends its first user message with the call's prompt."""
    calls = agent_calls(capture("fg_4_continuation.json")["body"]["messages"][-2]["content"])
    assert [c.description for c in calls] == ["Write the front end", "Write the back end"]
    assert all(c.background is False and c.subagent_type == "general-purpose" for c in calls)
    front = first_prompt(capture("fg_3_subagent_front.json")["body"])
    back = first_prompt(capture("fg_2_subagent_back.json")["body"])
    assert front is not None and front.endswith(calls[0].prompt)
    assert back is not None and back.endswith(calls[1].prompt)
    # A fork's directive is the end of its last user message's text too.
    fork = capture("fork_2_subagent.json")["body"]
    assert first_prompt(fork) is not None


def test_tool_results_name_the_subagent_each_call_started() -> None:
    """Foreground results say ``agentId: …``; background ones name the task's output file."""
    fg = named_subagents(capture("fg_4_continuation.json")["body"])
    assert fg == {
        "toolu_01AAAAAAAAAAAAAAAAAAAAAAAA": sub_id("fg_3_subagent_front.json"),
        "toolu_01BBBBBBBBBBBBBBBBBBBBBBBB": sub_id("fg_2_subagent_back.json"),
    }
    bg = named_subagents(capture("bg_2_coordinator_next.json")["body"])
    assert set(bg.values()) == {sub_id("bg_3_subagent.json"), sub_id("bg_4_subagent.json")}


def test_foreground_fan_out_replayed_gives_a_tree_of_three() -> None:
    """The captured foreground fan-out: coordinator, then two sub-agents named and waited on."""
    tree = AgentDirectory()
    first = capture("fg_1_coordinator.json")
    assert tree.request(ROOT, None, 1, first["body"], now=0.0).agent == ROOT
    # agentkv streamed the reply that ended the coordinator's turn in two Agent calls.
    reply = capture("fg_4_continuation.json")["body"]["messages"][-2]["content"]
    tree.reply(ROOT, reply, ended_in_tools=True, now=10.0)
    assert tree.waiting_parents(10.0) == {ROOT}
    places = {}
    for name in ("fg_2_subagent_back.json", "fg_3_subagent_front.json"):
        body = capture(name)["body"]
        places[name] = tree.request(ROOT, sub_id(name), 1, body, now=10.1)
    back, front = places["fg_2_subagent_back.json"], places["fg_3_subagent_front.json"]
    assert back.parent == ROOT and back.description == "Write the back end"
    assert front.parent == ROOT and front.description == "Write the front end"
    assert back.waited_on and front.waited_on
    assert back.priority == front.priority == 1
    rows = tree.view(11.0)
    assert [r.agent for r in rows] == [
        ROOT,
        agent_name(ROOT, sub_id("fg_2_subagent_back.json")),
        agent_name(ROOT, sub_id("fg_3_subagent_front.json")),
    ]
    assert [r.depth for r in rows] == [0, 1, 1]
    assert rows[0].waiting_for == 2
    # The continuation arrives: the coordinator waits for nothing any more.
    tree.request(ROOT, None, 1, capture("fg_4_continuation.json")["body"], now=20.0)
    assert tree.waiting_parents(20.0) == frozenset()


def test_subagents_seen_before_the_call_link_when_the_parents_next_request_names_them() -> None:
    """Without the streamed reply, the continuation's calls and results link them afterwards."""
    tree = AgentDirectory()
    tree.request(ROOT, None, 1, capture("fg_1_coordinator.json")["body"], now=0.0)
    for name in ("fg_2_subagent_back.json", "fg_3_subagent_front.json"):
        place = tree.request(ROOT, sub_id(name), 1, capture(name)["body"], now=1.0)
        # Not linked yet, but the coordinator has sent nothing since: it waits for them.
        assert place.description is None and place.waited_on and place.priority == 1
    tree.request(ROOT, None, 1, capture("fg_4_continuation.json")["body"], now=5.0)
    described = {r.agent: r.description for r in tree.view(5.0)}
    assert described[agent_name(ROOT, sub_id("fg_3_subagent_front.json"))] == (
        "Write the front end"
    )
    assert described[agent_name(ROOT, sub_id("fg_2_subagent_back.json"))] == "Write the back end"


def test_background_subagents_run_one_level_less_urgent_once_the_parent_goes_on() -> None:
    """The captured background fan-out: the coordinator's next request came first."""
    tree = AgentDirectory()
    tree.request(ROOT, None, 1, capture("bg_1_coordinator.json")["body"], now=0.0)
    tree.request(ROOT, None, 1, capture("bg_2_coordinator_next.json")["body"], now=1.0)
    for name in ("bg_3_subagent.json", "bg_4_subagent.json"):
        place = tree.request(ROOT, sub_id(name), 1, capture(name)["body"], now=1.2)
        assert place.parent == ROOT
        assert place.description is not None
        assert not place.waited_on
        assert place.priority == 2
    assert all(r.background for r in tree.view(2.0) if r.parent)


def test_a_background_call_the_turn_ended_in_is_waited_on_until_the_parent_speaks() -> None:
    """Background, but the parent's turn ended in it and it is silent since: parent's priority."""
    tree = AgentDirectory(background_offset=2)
    tree.request("s", None, 0, user("go"), now=0.0)
    tree.reply(
        "s", [call_block("c1", "task one", run_in_background=True)], ended_in_tools=True, now=1
    )
    place = tree.request("s", "a1", 0, user("context\n\ntask one"), now=2.0)
    assert place.waited_on and place.priority == 0
    tree.request("s", None, 0, user("go on"), now=3.0)
    described = tree.describe("s/a1")
    assert described is not None and described.priority == 2
    place = tree.request("s", "a1", 0, user("context\n\ntask one"), now=4.0)
    assert not place.waited_on and place.priority == 2
    # The root's own request keeps its own priority.
    assert tree.request("s", None, 0, user("more"), now=5.0).priority == 0


def test_offset_zero_runs_every_subagent_at_its_parents_priority() -> None:
    tree = AgentDirectory(background_offset=0)
    tree.request("s", None, 2, user("go"), now=0.0)
    tree.request(
        "s",
        None,
        2,
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [call_block("c1", "bg task", run_in_background=True)],
                },
            ]
        },
        now=1.0,
    )
    assert tree.request("s", "a1", 2, user("bg task"), now=2.0).priority == 2


def test_priority_never_passes_background() -> None:
    tree = AgentDirectory(background_offset=3)
    tree.request("s", None, 2, user("go"), now=0.0)
    tree.request(
        "s",
        None,
        2,
        {
            "messages": [
                {"role": "assistant", "content": [call_block("c1", "t", run_in_background=True)]},
            ]
        },
        now=1.0,
    )
    assert tree.request("s", "a1", 2, user("t"), now=2.0).priority == 3


def test_two_subagents_with_the_same_prompt_take_one_call_each() -> None:
    tree = AgentDirectory()
    tree.request("s", None, 1, user("go"), now=0.0)
    blocks = [call_block("c1", "same"), call_block("c2", "same")]
    tree.reply("s", blocks, ended_in_tools=True, now=1.0)
    tree.request("s", "a1", 1, user("same"), now=2.0)
    tree.request("s", "a2", 1, user("same"), now=2.0)
    views = {r.agent: r for r in tree.view(2.0)}
    assert views["s/a1"].parent == views["s/a2"].parent == "s"
    assert tree._agents["s"].taken == {"c1": "s/a1", "c2": "s/a2"}


def test_a_nested_subagent_hangs_under_the_subagent_that_called_it() -> None:
    tree = AgentDirectory()
    tree.request("s", None, 1, user("go"), now=0.0)
    tree.reply("s", [call_block("c1", "plan it")], ended_in_tools=True, now=1.0)
    tree.request("s", "a1", 1, user("plan it"), now=2.0)
    tree.reply("s/a1", [call_block("c2", "look it up")], ended_in_tools=True, now=3.0)
    place = tree.request("s", "b2", 1, user("look it up"), now=4.0)
    assert place.parent == "s/a1"
    assert [(r.agent, r.depth) for r in tree.view(4.0)] == [("s", 0), ("s/a1", 1), ("s/b2", 2)]


def test_an_unknown_prompt_stays_unlinked_under_its_session() -> None:
    tree = AgentDirectory()
    tree.request("s", None, 1, user("go"), now=0.0)
    place = tree.request("s", "a1", 1, user("something else"), now=1.0)
    assert place.parent == "s" and place.description is None


def test_bounded_memory_forgets_idle_and_oldest_agents() -> None:
    """Nothing grows without bound: an idle agent is forgotten, and at most max_agents are kept."""
    tree = AgentDirectory(max_agents=3, idle_ttl=100.0, max_calls=2)
    for i in range(10):
        tree.request(f"r{i}", None, 1, user("x"), now=float(i))
    assert len(tree) == 3
    tree.request("late", None, 1, user("x"), now=500.0)
    assert [r.agent for r in tree.view(500.0)] == ["late"]
    blocks = [call_block(f"c{i}", f"p{i}") for i in range(10)]
    tree.reply("late", blocks, ended_in_tools=False, now=501.0)
    assert len(tree._agents["late"].calls) == 2


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_use", "id": "x", "name": "Agent", "input": "not an object"},
        {"type": "tool_use", "id": "x", "name": "Agent", "input": {"prompt": ""}},
        {"type": "tool_use", "id": 3, "name": "Agent", "input": {"prompt": "p"}},
        {"type": "tool_use", "id": "x", "name": "Bash", "input": {"prompt": "p"}},
        {"type": "text", "text": "hi"},
        "junk",
    ],
)
def test_malformed_calls_are_ignored(block: Any) -> None:
    assert agent_calls([block]) == []


def test_a_call_keeps_what_the_tree_shows() -> None:
    (call,) = agent_calls([call_block("c", "  p  ", subagent_type="fork", run_in_background="yes")])
    assert call == AgentCall(
        id="c", prompt="p", description="do   p  ", subagent_type="fork", background=None
    )
    assert not call.waited_on


def test_an_abandoned_fan_out_stops_being_kept_warm() -> None:
    tree = AgentDirectory(wait_ttl=60.0)
    tree.request("s", None, 1, user("go"), now=0.0)
    tree.reply("s", [call_block("c1", "t")], ended_in_tools=True, now=1.0)
    tree.request("s", "a1", 1, user("t"), now=2.0)
    assert tree.waiting_parents(30.0) == {"s"}
    assert tree.waiting_parents(100.0) == frozenset()


def test_a_subagent_of_an_unseen_coordinator_is_waited_on_under_it() -> None:
    """The coordinator's requests never reached agentkv: it still heads the tree, silent."""
    tree = AgentDirectory()
    place = tree.request("s", "a1", 0, user("task"), now=5.0)
    assert place.parent == "s" and place.waited_on and place.priority == 0
    rows = tree.view(6.0)
    assert [(r.agent, r.depth, r.requests) for r in rows] == [("s", 0, 0), ("s/a1", 1, 1)]
    assert rows[0].waiting_for == 1
