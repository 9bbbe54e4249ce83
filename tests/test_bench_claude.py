"""The Claude-Code-shaped benchmark workloads, and the pieces of their reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from agentkv import MessagesTranslator
from agentkv_bench.claude import make_project
from agentkv_bench.claude_workload import (
    ClaudeSpec,
    PrioritySpec,
    build_claude_workload,
    build_priority_workload,
    claude_template,
    new_agent_workload,
    shrink,
)
from agentkv_bench.drivers import RequestResult
from agentkv_bench.report import render_table, summarize
from agentkv_bench.scenarios import answers_correct
from agentkv_bench.workload import minimum_prefill


def _words(body: dict[str, Any]) -> str:
    text: str = body["messages"][0]["content"][-1]["text"]
    return text


def _without_words(body: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    out["messages"][0]["content"][-1]["text"] = ""
    del out["metadata"]
    return out


def test_template_is_a_real_claude_code_first_request_without_local_paths() -> None:
    """The shipped capture has Claude Code's shape and names no home or work directory."""
    body = claude_template()
    text = json.dumps(body)
    assert "/root/" not in text and "/work/" not in text
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["messages"][1]["content"][0]["text"].startswith("# Environment")
    assert len(body["tools"]) >= 10
    MessagesTranslator().translate(body)


def test_fresh_sessions_differ_only_in_their_words_and_session() -> None:
    """Every fresh session is the captured request with other words and another session id."""
    workload = build_claude_workload(ClaudeSpec())
    firsts = [a.requests[i] for a in workload.agents for i in range(len(a.requests))]
    assert len(firsts) == 3 * 2
    assert len({_words(b) for b in firsts}) == len(firsts)
    assert len({b["metadata"]["user_id"] for b in firsts}) == len(firsts)
    reference = _without_words(firsts[0])
    assert all(_without_words(b) == reference for b in firsts)
    assert all(b["max_tokens"] == ClaudeSpec().max_tokens and b["stream"] for b in firsts)


def test_follow_ups_append_to_their_session() -> None:
    """A follow-up repeats its session's request and adds a tool call and its result."""
    spec = ClaudeSpec(agents=2, sessions=2, followups=2)
    workload = build_claude_workload(spec)
    for agent in workload.agents:
        assert agent.sessions == (0, 0, 0, 1, 1, 1)
        for i in range(1, len(agent.requests)):
            before, after = agent.requests[i - 1], agent.requests[i]
            if agent.sessions[i] != agent.sessions[i - 1]:
                assert _words(after) != _words(before)
                continue
            n = len(before["messages"])
            assert after["messages"][:n] == before["messages"]
            call, result = after["messages"][n:]
            assert call["content"][-1]["type"] == "tool_use"
            assert result["content"][0]["tool_use_id"] == call["content"][-1]["id"]
    translator = MessagesTranslator()
    for _, _, body in workload.canonical_order():
        translator.translate(body)


def test_shrink_keeps_the_shape_and_cuts_the_length() -> None:
    """A scaled-down request keeps every part in its place, the user's words whole."""
    full = claude_template()
    small = shrink(full, 0.125)
    assert len(json.dumps(small)) < len(json.dumps(full)) / 4
    assert [m["role"] for m in small["messages"]] == [m["role"] for m in full["messages"]]
    assert small["messages"][0]["content"][-1] == full["messages"][0]["content"][-1]
    assert small["system"][0] == full["system"][0]
    assert 1 <= len(small["tools"]) < len(full["tools"])
    assert shrink(full, 1.0) == full


def test_new_agent_uses_words_no_earlier_agent_used() -> None:
    spec = ClaudeSpec()
    earlier = {_words(b) for _, _, b in build_claude_workload(spec).canonical_order()}
    (newcomer,) = new_agent_workload(spec).agents
    assert len(newcomer.requests) == 1
    assert _words(newcomer.requests[0]) not in earlier


def test_priority_rounds_bring_p0_while_sub_agents_prefill() -> None:
    """Each round: sub-agents (P1, P2) with prompts of their own from the start of the system
    text, and the coordinator's next turn, appended to its previous one, ``delay`` s later."""
    spec = PrioritySpec(rounds=3, subagents=2, delay=2.0)
    warmup, rounds = build_priority_workload(spec)
    (coordinator,) = warmup.agents
    assert coordinator.priority == 0
    previous = coordinator.requests[0]
    seen_systems = {previous["system"][1]["text"][:60]}
    for rnd in rounds:
        subs = [a for a in rnd.agents if a.priority > 0]
        (p0,) = [a for a in rnd.agents if a.priority == 0]
        assert {a.priority for a in subs} == {1, 2}
        assert all(a.start == 0 for a in subs) and p0.start == spec.delay
        turn = p0.requests[0]
        assert turn["messages"][: len(previous["messages"])] == previous["messages"]
        previous = turn
        for sub in subs:
            head = sub.requests[0]["system"][1]["text"][:60]
            assert head not in seen_systems
            seen_systems.add(head)


def test_minimum_counts_the_shared_head_of_fresh_sessions_once() -> None:
    """Token-level check of the yardstick on Claude-Code-like sequences: a long shared head and
    short own tails cost the head once."""
    head = list(range(1000))
    sessions = [[*head, 5000 + i, 6000 + i] for i in range(6)]
    assert minimum_prefill(sessions) == 1000 + 6 * 2


def _result(agent: str, turn: int, text: str, ttft: float = 1.0) -> RequestResult:
    return RequestResult(
        agent=agent,
        priority=1,
        turn=turn,
        submitted=0.0,
        ttft=ttft,
        done=2.0,
        output_tokens=2,
        text=text,
    )


def test_answers_are_checked_against_the_word_asked() -> None:
    workload = build_claude_workload(ClaudeSpec(agents=1, sessions=2, followups=1))
    (agent,) = workload.agents
    asked = [_words(agent.requests[0]).split()[-1], _words(agent.requests[2]).split()[-1]]
    results = [
        _result(agent.name, 0, asked[0].capitalize() + "."),
        _result(agent.name, 1, "anything: a follow-up is not checked"),
        _result(agent.name, 2, "something else"),
    ]
    assert answers_correct(workload, results) == (1, 2)


def test_summary_and_table_show_each_agents_first_answer() -> None:
    results = [_result("a", 0, "x", ttft=3.0), _result("a", 1, "y", ttft=0.5)]
    results.append(attrs.evolve(_result("b", 0, "z", ttft=7.0), submitted=1.0))
    counters = {"prompt_computed": 900.0, "prompt_cached": 100.0, "predicted": 6.0}
    summary = summarize("plain", 10.0, results, counters, None)
    assert summary["agents"]["a"]["first_ttft_s"] == 3.0
    assert summary["agents"]["b"]["first_ttft_s"] == 7.0
    assert summary["cache_hit_ratio"] == 0.1
    table = render_table(
        [summary], [("first of b", lambda c: str(c["agents"]["b"]["first_ttft_s"]))]
    )
    assert table.splitlines()[0].startswith("|")
    assert "7.0" in table.splitlines()[-1]


@pytest.mark.skipif(not Path("/usr/bin/git").exists(), reason="needs git")
def test_real_cli_project_is_the_same_every_time(tmp_path: Path) -> None:
    """The project's commit (which Claude Code puts in its prompt) does not depend on when or
    where it was made."""
    import subprocess

    heads = []
    for name in ("one", "two"):
        project, home = make_project(tmp_path / name)
        assert home.is_dir()
        heads.append(
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True
            ).stdout
        )
    assert heads[0] == heads[1] and heads[0].strip()


@pytest.mark.engine
def test_quick_claude_scenario_report_is_consistent(tmp_path: Path) -> None:
    """A quick run of the Claude-Code-shaped scenario, llama-server alone against agentkv (the
    tuned configuration runs in the quick agents scenario): the engine's counters agree with the
    prompts' own tokenization, and agentkv's layout shares more."""
    from agentkv_bench import cli
    from tests._engine_fixture import locate_engine

    locate_engine()
    out = tmp_path / "bench"
    argv = ["--scenario", "claude", "--quick", "--ctx-per-slot", "8192", "--out", str(out)]
    argv += ["--configs", "plain,agentkv"]
    assert cli.main(argv) == 0
    report = json.loads((out / "claude.json").read_text())
    assert (out / "claude.png").read_bytes().startswith(b"\x89PNG")
    sticks = report["yardsticks"]
    # Session layout puts the environment note before the user's words: agents share it.
    assert sticks["agentkv"]["minimum"] < sticks["client"]["minimum"]
    configs = {c["name"]: c for c in report["configs"]}
    assert set(configs) == {"plain", "agentkv"}
    spec = ClaudeSpec.quick()
    for config in configs.values():
        assert config["errors"] == 0
        assert config["requests"] == spec.agents * spec.sessions * (1 + spec.followups)
        assert set(config["agents"]) == {f"agent-{i}" for i in range(spec.agents)}
        assert all(a["first_ttft_s"] > 0 for a in config["agents"].values())
        stick = sticks[config["layout"]]
        # No cache computes less than the minimum (a little slack for templating differences).
        assert config["prefill_computed"] >= 0.9 * stick["minimum"]
        assert config["prompt_tokens_total"] >= 0.95 * stick["naive"]
    naive = sticks["client"]["naive"]
    assert abs(configs["plain"]["prompt_tokens_total"] - naive) <= 0.05 * naive
    placements = configs["agentkv"]["agentkv"]["placements"]
    assert placements["acquired"] >= configs["agentkv"]["requests"]


@pytest.mark.engine
def test_quick_restart_scenario_restores_the_shared_prefix(tmp_path: Path) -> None:
    """After a restart on the same store, a new agent's prompt comes mostly from the store: it
    computes less than the same agent on a server without a store."""
    from agentkv_bench import cli
    from tests._engine_fixture import locate_engine

    locate_engine()
    out = tmp_path / "bench"
    argv = ["--scenario", "restart", "--quick", "--ctx-per-slot", "8192", "--out", str(out)]
    argv += ["--agents", "1", "--sessions", "1", "--followups", "0"]
    assert cli.main(argv) == 0
    report = json.loads((out / "restart.json").read_text())
    after, cold = report["configs"]
    assert after["errors"] == 0 and cold["errors"] == 0
    assert report["store_after_restart"]["directory_entries"] >= 1
    assert cold["prefill_computed"] >= 0.9 * report["newcomer_tokens"]
    assert after["prefill_computed"] < cold["prefill_computed"] / 2


def _summary(name: str, stick: Any = None) -> dict[str, Any]:
    from agentkv_bench.metrics import PrefillYardstick

    results = [
        RequestResult("coordinator", 0, 0, 0.0, 1.5, 2.0, 2, text="ready", phase="round 0"),
        RequestResult("agent-0", 1, 0, 0.0, 4.0, 5.0, 2, text="alpha"),
        RequestResult("agent-1", 2, 0, 0.1, 6.0, 7.0, 2, text="delta"),
    ]
    counters = {"prompt_computed": 1200.0, "prompt_cached": 800.0}
    yardstick = PrefillYardstick(minimum=1000, naive=2000, requests=3) if stick else None
    summary = summarize(name, 7.0, results, counters, yardstick, {"layout": "client"})
    summary.update(answers_correct=2, asked=2, agentkv={})
    return summary


def test_every_scenario_table_renders_from_a_summary(tmp_path: Path) -> None:
    """The text reports of the claude, restart and priority scenarios show their figures."""
    import anyio

    from agentkv_bench.report import write_report
    from agentkv_bench.scenarios import claude_table, priority_table, restart_table

    machine = {"ctx_per_slot": 32768}
    sticks = {
        "client": {"minimum": 1000, "naive": 2000},
        "agentkv": {"minimum": 900, "naive": 2000},
    }
    claude = {
        **machine,
        "workload": attrs.asdict(ClaudeSpec()),
        "yardsticks": sticks,
        "configs": [_summary("plain", True), _summary("agentkv", True)],
    }
    text = claude_table(claude)
    assert "agent-1: first answer" in text and "| 6 s" in text.replace("6.0 s", "6 s")
    assert "1.2×" in text  # computed / minimum
    priority = {
        "workload": attrs.asdict(PrioritySpec()),
        "configs": [_summary("alone"), _summary("tuned", True)],
    }
    text = priority_table(priority)
    assert "TTFT P0 p50 / p95" in text and "| 200 " in text  # computed twice
    restart = {
        "configs": [_summary("agentkv"), _summary("agentkv-nostore")],
        "speedup": 25.0,
        "ttft_after_restart_s": 1.5,
        "ttft_cold_s": 37.5,
        "newcomer_own_tokens": 12,
        "first_life": _summary("agentkv", True),
        "store_after_restart": {"directory_entries": 2, "bytes": 1000},
    }
    assert "25× sooner" in restart_table(restart).replace("25.0×", "25×")

    async def write() -> None:
        await write_report(
            claude, "x", tmp_path, stem="claude", panels=[("wall", lambda c: c["wall_s"])]
        )

    anyio.run(write)
    assert json.loads((tmp_path / "claude.json").read_text())["configs"][0]["name"] == "plain"
    assert (tmp_path / "claude.png").read_bytes().startswith(b"\x89PNG")
