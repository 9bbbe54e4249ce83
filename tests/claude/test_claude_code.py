"""The real Claude Code CLI (``claude -p``) against ``agentkv-server`` with the default model.

Each test runs the CLI with exactly the lines the server printed, in a fresh git project of its
own. They share one server, in this order: the first answer (project A, ``cold_answer``) warms the
engine with Claude Code's shared prompt, and the later tests, each in another project, reuse it.
On 2 CPU cores the module takes several minutes.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.claude._cli import (
    AgentKVServer,
    ClaudeRun,
    RecordingProxy,
    engine_runs,
    exported,
    make_project,
    run_claude,
)

pytestmark = [pytest.mark.claude, pytest.mark.engine]

#: A file-writing task ends within this many seconds, with the file or a clear failure
#: (docs/claude-code.md states the same bound).
TOOL_TASK_BOUND_S = 900
#: A one-word answer, cold engine included, on 2 cores.
ANSWER_BOUND_S = 600

FILE_TASK = "Create a file named hello.txt containing exactly the text: hi"
#: What a client timeout looks like in Claude Code's output.
TIMEOUT_WORDS = ("timed out", "timeout", "Request was aborted")


def one_word(word: str) -> str:
    return f"Reply with the single word: {word}"


def assert_clean_answer(run: ClaudeRun, word: str) -> None:
    assert not run.timed_out, run.describe()
    assert run.returncode == 0, run.describe()
    assert run.stdout == f"{word}\n", run.describe()
    assert run.warnings() == [], run.describe()


@attrs.frozen
class FirstAnswer:
    """An agent's run and what the slot table says about its (only) request."""

    run: ClaudeRun
    record: dict[str, Any]

    @property
    def computed(self) -> int:
        """Prompt tokens the engine computed for it, a head computed on its own first included."""
        return int(self.record["computed_tokens"])


def first_answer(
    server: AgentKVServer, word: str, *, project: Path, home: Path, claude: Path
) -> FirstAnswer:
    """The first agent in ``project``: ``claude -p`` with a one-word task, and its request."""
    run = run_claude(
        server.env_lines,
        one_word(word),
        project=make_project(project),
        home=home,
        timeout=ANSWER_BOUND_S,
        claude=claude,
    )
    assert_clean_answer(run, word)
    recent = [r for r in server.table().get("recent", []) if r.get("slot") is not None]
    return FirstAnswer(run, recent[-1])


@pytest.fixture(scope="module")
def cold_answer(
    agentkv_server: AgentKVServer,
    claude_home: Path,
    claude_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> FirstAnswer:
    """The run's first agent, in project A, on an engine that holds nothing yet."""
    project = tmp_path_factory.mktemp("project-a") / "demo"
    return first_answer(
        agentkv_server, "alpha", project=project, home=claude_home, claude=claude_bin
    )


@pytest.mark.timeout(ANSWER_BOUND_S + 120)
def test_printed_lines_give_a_clean_one_word_answer(
    agentkv_server: AgentKVServer, cold_answer: FirstAnswer
) -> None:
    env = exported(agentkv_server.env_lines)
    # The window Claude Code is told is the slot's real one, so it compacts before a slot
    # overflows; the model id is one it does not know, so that window applies.
    assert int(env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]) >= 32768, agentkv_server.env_lines
    assert env["ANTHROPIC_MODEL"] and not env["ANTHROPIC_MODEL"].startswith("claude-")
    assert_clean_answer(cold_answer.run, "alpha")


@pytest.mark.timeout(2 * ANSWER_BOUND_S + 120)
def test_first_agent_in_another_project_starts_warm(
    agentkv_server: AgentKVServer,
    cold_answer: FirstAnswer,
    claude_home: Path,
    claude_bin: Path,
    tmp_path: Path,
) -> None:
    """After one agent in project A, the first agent in project B reuses all but the project's
    own lines of Claude Code's prompt (the session layout) and answers in a fifth of the time."""
    cold = cold_answer
    assert cold.computed >= 0.9 * cold.record["prompt_tokens"], cold.record  # it was cold
    warm = first_answer(
        agentkv_server, "beta", project=tmp_path / "other", home=claude_home, claude=claude_bin
    )
    shared = warm.record["cached_tokens"] / warm.record["prompt_tokens"]
    print(
        f"project A: {cold.run.elapsed:.1f} s, computed {cold.computed}; project B: "
        f"{warm.run.elapsed:.1f} s ({warm.run.elapsed / cold.run.elapsed:.3f}x), cached "
        f"{warm.record['cached_tokens']} of {warm.record['prompt_tokens']} ({shared:.2%})"
    )
    assert warm.run.elapsed <= 0.2 * cold.run.elapsed, (cold.record, warm.record)
    assert shared >= 0.98, warm.record


@pytest.mark.timeout(2 * ANSWER_BOUND_S + 120)
def test_two_agents_at_once_in_one_project_both_answer(
    agentkv_server: AgentKVServer, claude_home: Path, claude_bin: Path, tmp_path: Path
) -> None:
    project = make_project(tmp_path / "demo")
    words = ("alpha", "beta")
    with concurrent.futures.ThreadPoolExecutor(len(words)) as pool:
        futures = [
            pool.submit(
                run_claude,
                agentkv_server.env_lines,
                one_word(word),
                project=project,
                home=claude_home,
                timeout=2 * ANSWER_BOUND_S,
                claude=claude_bin,
            )
            for word in words
        ]
        runs = [f.result() for f in futures]
    for run, word in zip(runs, words, strict=True):
        assert_clean_answer(run, word)


@pytest.mark.timeout(TOOL_TASK_BOUND_S + 180)
def test_file_task_ends_in_bound_with_the_file_or_a_clear_failure(
    agentkv_server: AgentKVServer, claude_home: Path, claude_bin: Path, tmp_path: Path
) -> None:
    project = make_project(tmp_path / "demo")
    with RecordingProxy(agentkv_server.url) as proxy:
        run = run_claude(
            agentkv_server.env_lines,
            FILE_TASK,
            project=project,
            home=claude_home,
            args=["--permission-mode", "acceptEdits"],
            timeout=TOOL_TASK_BOUND_S,
            base_url=proxy.url,
            claude=claude_bin,
        )
    sent = proxy.messages()
    assert not run.timed_out, f"no end within {TOOL_TASK_BOUND_S} s: " + run.describe()
    output = run.stdout + run.stderr
    assert not any(word.lower() in output.lower() for word in TIMEOUT_WORDS), run.describe()

    # Never a duplicate computation: every request the engine ran for this session is a distinct
    # one, even when Claude Code sent one again (a retry, or the same request without streaming).
    sessions = {e.session for e in sent if e.session}
    assert len(sessions) <= 1, sessions
    for session in sessions:
        distinct = {e.identity() for e in sent}
        retries = [e for e in sent if e.retry_count > 0]
        table = agentkv_server.table()
        ran = engine_runs(table, session)
        # The slot table lists only the last 16 requests: it covers the session when it lists
        # fewer, or when its oldest is another agent's.
        recent = table.get("recent", [])
        covered = len(recent) < 16 or recent[0].get("agent") != session
        assert covered or len(distinct) == len(sent), (
            f"Claude Code sent {len(sent) - len(distinct)} requests again, and the slot table no "
            "longer lists the whole session"
        )
        assert len(ran) <= len(distinct), (
            f"{len(ran)} engine runs for {len(distinct)} distinct requests "
            f"({len(sent)} sent, {len(retries)} marked as retries)"
        )

    # What the session ends with is the model's doing: the file, or an answer in words (the
    # default model sometimes writes the file's content as text instead of calling Write), or
    # an error that says why. Never silence: Claude Code prints something either way. How often
    # the default model gets the file right is measured by tests/claude/tool_task_rate.py
    # (docs/claude-code.md).
    hello = project / "hello.txt"
    outcome = "file" if hello.is_file() else "no file"
    print(f"file task: {outcome}, exit {run.returncode}, {run.elapsed:.0f} s, {len(sent)} requests")
    if run.returncode == 0:
        assert hello.is_file() or run.stdout.strip(), "no file and no answer: " + run.describe()
    else:
        # An error says why (not just Claude Code's model diagnostic).
        assert run.stdout.strip() or run.warnings(), "a silent error: " + run.describe()
