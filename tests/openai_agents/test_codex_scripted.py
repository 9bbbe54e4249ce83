"""The real Codex CLI through ``agentkv-server`` in front of a scripted engine (seconds, no model).

The default model rarely calls a tool, so the engine's replies are scripted here, in the test
harness: the first asks (as the model would write it, as text) to run ``cat secret.txt``; the second
repeats what the tool message it received says. Codex must take agentkv's ``function_call``, run
the command, and send its output back; agentkv must deliver that output to the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.claude._cli import AgentKVServer
from tests.fakes import FakeLlama
from tests.openai_agents._codex import codex_config, run_codex
from tests.openai_agents._engine import SCRIPTED_ARGS, engine_over_http

pytestmark = pytest.mark.codex

CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat secret.txt"}}\n</tool_call>'


def repeat_tool_output(body: dict[str, Any]) -> str:
    results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    return "The file says: " + (results[-1] if results else "(no tool output arrived)")


@pytest.mark.timeout(300)
def test_codex_runs_a_call_and_its_output_reaches_the_engine(
    codex_bin: Path, tmp_path: Path
) -> None:
    """A scripted call of ``exec_command`` goes through Codex and back within one session."""
    fake = FakeLlama(script=[CALL, repeat_tool_output])
    project = tmp_path / "project"
    project.mkdir()
    (project / "secret.txt").write_text("kiwi-42\n")
    with engine_over_http(fake) as engine:
        args = ["--upstream", engine, *SCRIPTED_ARGS]
        with AgentKVServer(tmp_path / "server", extra_args=args) as server:
            config, env = codex_config(server.log())
            run = run_codex(
                config,
                env,
                "What does secret.txt say?",
                project=project,
                home=tmp_path / "codex-home",
                timeout=180,
                codex=codex_bin,
            )
            recent = server.table()["recent"]
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert run.warnings() == [], run.describe()
    assert "kiwi-42" in run.stdout, run.describe()
    assert len(fake.requests) == 2
    tool_messages = [m for m in fake.requests[1]["messages"] if m["role"] == "tool"]
    assert "kiwi-42" in tool_messages[-1]["content"]
    # One Codex session is one agent; its second turn reused the first one's prompt.
    first, second = recent[-2:]
    assert first["agent"] == second["agent"] != "anonymous"
    assert second["cached_tokens"] >= first["prompt_tokens"] - 1


def coordinator_and_sub_agent(body: dict[str, Any]) -> str:
    """The coordinator spawns a sub-agent, waits for it, and says "done"; the sub-agent says
    "gamma". Decided from what the request holds, as the two run at the same time."""
    messages = body["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    asks = " ".join(str(m["content"]) for m in messages if m["role"] == "user")
    if results and '"agent_id"' in results[-1]:
        target = json.loads(results[-1])["agent_id"]
        call = {"name": "multi_agent_v1.wait_agent", "arguments": {"targets": [target]}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if results:
        return "done"
    if "Use a sub-agent" in asks:
        call = {
            "name": "multi_agent_v1.spawn_agent",
            "arguments": {"message": "Reply with the single word: gamma"},
        }
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return "gamma"


@pytest.mark.timeout(300)
def test_a_codex_sub_agent_is_an_agent_of_its_own(codex_bin: Path, tmp_path: Path) -> None:
    """A scripted ``multi_agent_v1.spawn_agent`` call reaches Codex as a namespaced call; the
    sub-agent it starts is queued and recorded as a second agent (its own thread)."""
    fake = FakeLlama(script=[coordinator_and_sub_agent] * 20)
    with engine_over_http(fake) as engine:
        args = ["--upstream", engine, *SCRIPTED_ARGS]
        with AgentKVServer(tmp_path / "server", extra_args=args) as server:
            config, env = codex_config(server.log())
            run = run_codex(
                config,
                env,
                "Use a sub-agent to say gamma",
                project=tmp_path / "project",
                home=tmp_path / "codex-home",
                timeout=180,
                codex=codex_bin,
            )
            recent = server.table()["recent"]
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert run.answer() == "done", run.describe()
    assert run.warnings() == [], run.describe()
    agents = {record["agent"] for record in recent}
    assert len(agents) == 2, recent  # the coordinator's thread and the sub-agent's
    assert all(record["status"] == "ok" for record in recent), recent
    sub_agent = [r for r in fake.requests if "gamma" in str(r["messages"][-1]["content"])]
    assert sub_agent, "the sub-agent's request did not reach the engine"
