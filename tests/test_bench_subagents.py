"""The ``subagents`` benchmark scenario: its workload, its scripted replies and its report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentkv.agents import AgentDirectory, agent_calls, first_prompt, named_subagents
from agentkv.anthropic_sse import accumulate, anthropic_events
from agentkv.translate import MessagesTranslator
from agentkv_bench import cli
from agentkv_bench.subagents import (
    SESSION,
    SubagentsSpec,
    agent_call,
    build_subagents,
    scripted_reply,
    subagents_table,
    targets,
)


def test_scripted_reply_is_a_valid_stream_ending_in_tool_use() -> None:
    blocks = [
        {"type": "text", "text": "Splitting."},
        agent_call("c1", "Write the tests", "test it", background=False),
    ]
    message = accumulate(anthropic_events(scripted_reply(blocks)))
    assert message["stop_reason"] == "tool_use"
    assert message["content"][1]["input"]["run_in_background"] is False
    assert [c.description for c in agent_calls(message["content"])] == ["Write the tests"]


@pytest.mark.parametrize("spec", [SubagentsSpec(), SubagentsSpec.quick()], ids=["full", "quick"])
def test_the_workload_is_what_claude_code_sends(spec: SubagentsSpec) -> None:
    """Valid requests; sub-agents carry the session and their own id; prompts match calls."""
    workload = build_subagents(spec)
    translator = MessagesTranslator()
    for step in workload.order():
        translator.translate(step.body)
    subs = [*workload.background, workload.foreground]
    assert all(s.headers["x-claude-code-session-id"] == SESSION for s in subs)
    assert len({s.headers["x-claude-code-agent-id"] for s in subs}) == 3
    assert workload.other.headers["x-claude-code-session-id"] != SESSION
    assert workload.other.headers["x-agent-priority"] == str(spec.other_priority)
    # The coordinator's next turn carries the two background calls, and its continuation the
    # foreground one with a result naming its sub-agent.
    calls = [
        call
        for message in workload.continuation.body["messages"]
        if message["role"] == "assistant"
        for call in agent_calls(message["content"])
    ]
    assert [c.background for c in calls] == [True, True, False]
    for step in subs:
        prompt = first_prompt(step.body)
        assert prompt is not None and any(prompt.endswith(c.prompt) for c in calls)
    named = named_subagents(workload.continuation.body)
    assert set(named.values()) == {s.headers["x-claude-code-agent-id"] for s in subs}


def test_replayed_into_the_tree_the_foreground_one_is_waited_on() -> None:
    """Played in order, the tree gives background sub-agents a lower priority."""
    workload = build_subagents(SubagentsSpec.quick())
    tree = AgentDirectory()
    priority = SubagentsSpec().coordinator_priority

    def place(step: Any, now: float) -> Any:
        sub = step.headers.get("x-claude-code-agent-id")
        return tree.request(SESSION, sub, priority, step.body, now)

    place(workload.first, 0.0)
    place(workload.next_turn, 1.0)
    bg = [place(step, 1.1) for step in workload.background]
    fg = place(workload.foreground, 2.0)
    assert all(p.priority == priority + 1 and not p.waited_on for p in bg)
    assert fg.priority == priority and fg.waited_on
    place(workload.continuation, 3.0)
    described = {row.description for row in tree.view(3.0) if row.parent}
    assert described == {"Write the front end", "Write the back end", "Write the tests"}


def _config(name: str, wall: float, fg: float, cont: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "wall_s": wall,
        "errors": 0,
        "prefill_computed": extra.pop("computed", 1000),
        "prefill_tokens_per_s": 100.0,
        "steps": {
            "foreground sub-agent (tests)": {"ttft_s": fg},
            "coordinator: continuation": {"ttft_s": cont},
        },
        "continuation_record": extra.pop("record", None),
        **extra,
    }


def test_targets_and_table_say_what_was_met_and_what_was_not() -> None:
    report = {
        "facts": {
            "minimum": 900,
            "naive": 3000,
            "subagent_head_tokens": 400,
            "continuation_tokens": 1200,
            "continuation_new_tokens": 100,
            "tokens": {},
        },
        "configs": [
            _config("alone", 5, 4.0, 0),
            _config("plain", 100, 30, 10),
            _config(
                "agentkv",
                50,
                5.0,
                2.5,
                record={"prompt_tokens": 1200, "computed_tokens": 30},
            ),
            _config("agentkv-warm", 20, 1.0, 1.0),
        ],
    }
    found = targets(report)
    assert found["foreground_vs_alone"] == {"value": 1.25, "target": 1.5, "met": True}
    assert found["continuation_ttft"]["target"] == 3.0 and found["continuation_ttft"]["met"]
    assert found["head_computed_once"]["met"]  # 100 computed twice, under the 400-token head
    assert found["continuation_computed_share"]["met"]
    assert found["wall_vs_llama_server"] == {"value": 0.5, "target": 0.6, "met": True}
    assert found["warm_wall_vs_llama_server"]["met"] is False
    text = subagents_table({**report, "targets": found})
    assert "warm_wall_vs_llama_server: 0.2 (target 0.1): MISSED" in text
    assert "foreground sub-agent alone" in text.lower()


@pytest.mark.engine
def test_quick_subagents_scenario_runs_every_configuration(tmp_path: Path) -> None:
    """The CI-sized scenario on the real engine, on agentkv's configurations (the
    llama-server-alone run is the quick claude and agents scenarios' too, and the tree switched
    off is the server's tests'): every one answers, no errors, the tree is three sub-agents under
    the coordinator, the continuation reuses its context, and the warm run reuses the store."""
    from tests._engine_fixture import locate_engine

    locate_engine()
    out = tmp_path / "bench"
    argv = ["--scenario", "subagents", "--quick", "--configs", "alone,agentkv,agentkv-warm"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "subagents.json").read_text())
    configs = {c["name"]: c for c in report["configs"]}
    assert set(configs) == {"alone", "agentkv", "agentkv-warm"}
    assert all(c["errors"] == 0 for c in configs.values()), report["targets"]
    tree = configs["agentkv"]["tree"]
    children = [row for row in tree if row["parent"] == SESSION]
    assert len(children) == 3
    assert {row["waited_on"] for row in children} == {True, False}
    warm, cold = configs["agentkv-warm"], configs["agentkv"]
    assert warm["prefill_computed"] < cold["prefill_computed"] / 4, (warm, cold)
    record = configs["agentkv"]["continuation_record"]
    assert record["cached_tokens"] > 0.5 * record["prompt_tokens"], record
