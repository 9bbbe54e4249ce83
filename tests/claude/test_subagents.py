"""The real Claude Code CLI starting two sub-agents through agentkv: one tree of three agents.

The default model does not call Claude Code's ``Agent`` tool, so the TEST HARNESS answers the
coordinator's first request itself (a proxy between the CLI and agentkv) with two ``Agent``
calls. Everything else is real: the CLI starts the two sub-agents, their requests go to
agentkv-server and the default model answers them, and the coordinator's continuation (its calls
and the sub-agents' results) goes to agentkv too. On 2 CPU cores this takes several minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv_bench.fanout import request_kind
from agentkv_bench.subagents import agent_call, scripted_sse
from tests.claude._cli import AgentKVServer, Exchange, RecordingProxy, make_project, run_claude

pytestmark = [pytest.mark.claude, pytest.mark.engine]

#: Two sub-agents' ~7,900-token prompts (sharing their head, computed once) and the coordinator's
#: 12,400-token continuation, computed cold (agentkv never saw its first request): about 20,000
#: tokens of prefill, ~4 min on 2 idle cores. On a shared machine prefill ran at ~15 tokens/s and
#: a 1,500 s bound ended the run with the continuation at 85 %, so the bound leaves room for that.
BOUND_S = 2400
CALLS = (
    ("toolu_01TESTFRONTEND0000000000", "Write the front end", "front"),
    ("toolu_01TESTBACKEND00000000000", "Write the back end", "back"),
)


def coordinator_fans_out(exchange: Exchange) -> bytes | None:
    """The harness's answer to the coordinator's first request: two foreground Agent calls."""
    if exchange.method != "POST" or exchange.path != "/v1/messages":
        return None
    if request_kind(exchange.headers, exchange.json()) != "coordinator":
        return None  # sub-agents and the continuation go to agentkv
    blocks = [{"type": "text", "text": "I will split the work between two agents."}]
    blocks += [
        agent_call(call, what, f"Reply with the single word: {word}", background=False)
        for call, what, word in CALLS
    ]
    return scripted_sse(blocks)


@pytest.mark.timeout(BOUND_S + 180)
def test_coordinator_and_two_subagents_are_a_tree_of_three(
    agentkv_server: AgentKVServer, claude_home: Path, claude_bin: Path, tmp_path: Path
) -> None:
    project = make_project(tmp_path / "demo")
    with RecordingProxy(agentkv_server.url, script=coordinator_fans_out) as proxy:
        run = run_claude(
            agentkv_server.env_lines,
            "Split the work between two agents",
            project=project,
            home=claude_home,
            timeout=BOUND_S,
            base_url=proxy.url,
            claude=claude_bin,
        )
    assert not run.timed_out, run.describe()
    sent = proxy.messages()
    subagent_ids = sorted(
        {e.headers["x-claude-code-agent-id"] for e in sent if "x-claude-code-agent-id" in e.headers}
    )
    assert len(subagent_ids) == 2, [e.headers for e in sent]
    sessions = {e.session for e in sent}
    assert len(sessions) == 1, sessions
    (session,) = sessions
    assert session is not None
    # The sub-agents and the coordinator's continuation reached agentkv, and none failed.
    assert all(e.status == 200 for e in sent), [(e.status, e.path) for e in sent]
    assert run.returncode == 0, run.describe()

    table = agentkv_server.table()
    tree = {row["agent"]: row for row in table["tree"]}
    children = {f"{session}/{sub}" for sub in subagent_ids}
    assert set(tree) >= {session, *children}, list(tree)
    assert tree[session]["parent"] is None
    descriptions = {tree[child]["description"] for child in children}
    assert descriptions == {what for _, what, _ in CALLS}, [tree[c] for c in children]
    for child in children:
        row = tree[child]
        assert row["parent"] == session
        assert row["subagent_type"] == "general-purpose"
        assert row["background"] is False
        assert row["depth"] == 1
    # The coordinator comes first, then its sub-agents.
    order = [row["agent"] for row in table["tree"]]
    assert order.index(session) < min(order.index(child) for child in children)

    # Their requests' records name the parent and, once the continuation linked them, the call.
    records = [r for r in table["recent"] if r["agent"] in children]
    assert {r["agent"] for r in records} == children, table["recent"]
    for record in records:
        assert record["parent"] == session
        assert record["description"] in descriptions
        # The coordinator waited for them: they ran at its priority.
        assert record["waited_on"] is True
        assert record["status"] == "ok", record
    print(
        "sub-agents:",
        [(r["agent"], r["description"], r["computed_tokens"], r["cached_tokens"]) for r in records],
    )
