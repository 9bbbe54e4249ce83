"""Fast checks of the lines agentkv-server prints for Claude Code and of the CLI harness.

No engine and no real CLI: a stand-in ``claude`` script shows what the harness hands it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from agentkv_server.cli import claude_code_compacts_at, claude_code_env
from tests.claude._cli import ClaudeRun, exported, make_project, parse_env_lines, run_claude

URL = "http://127.0.0.1:8788"


def test_lines_name_one_model_for_every_tier_and_the_real_window() -> None:
    env = exported(claude_code_env(URL, None, ctx_per_slot=32768).splitlines())
    assert env["ANTHROPIC_BASE_URL"] == URL
    assert env["ANTHROPIC_API_KEY"] == "agentkv"
    tiers = ("OPUS", "SONNET", "HAIKU", "FABLE")
    assert {env[f"ANTHROPIC_DEFAULT_{t}_MODEL"] for t in tiers} == {"agentkv-local"}
    assert env["ANTHROPIC_MODEL"] == "agentkv-local"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    # A slow first token is waited for, and never answered by the same request without streaming.
    assert env["API_TIMEOUT_MS"] == env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == "1800000"
    assert env["CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK"] == "1"
    # Agent identity is left to Claude Code's session id unless the user opts in.
    assert "ANTHROPIC_CUSTOM_HEADERS" not in env


def test_lines_follow_the_server_options() -> None:
    lines = claude_code_env(
        URL, "s3cret", model_name="my-model", ctx_per_slot=65536, timeout=900
    ).splitlines()
    # The key itself never appears (the lines end up in logs): the shell reads it.
    assert not any("s3cret" in line for line in lines)
    assert 'export ANTHROPIC_API_KEY="$AGENTKV_API_KEY"' in lines
    env = exported(lines)
    assert env["API_TIMEOUT_MS"] == env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == "900000"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "my-model"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"


def test_unknown_or_small_window_is_said_in_a_comment() -> None:
    unknown = claude_code_env(URL, None)
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in exported(unknown.splitlines())
    assert "unknown" in unknown
    small = claude_code_env(URL, None, ctx_per_slot=16384)
    assert "too small for Claude Code" in small
    assert "too small" not in claude_code_env(URL, None, ctx_per_slot=32768)


def test_compaction_point_matches_what_claude_code_does() -> None:
    # Measured with Claude Code 2.1.328: window 32768, max output 4096 -> it compacts once its
    # context reaches 15672 tokens (docs/claude-code.md, "Window and compaction").
    assert claude_code_compacts_at(32768) == 15672


def test_block_is_found_in_the_server_output() -> None:
    block = claude_code_env(URL, None, ctx_per_slot=32768)
    output = (
        "agentkv-server: llama-server is ready on http://127.0.0.1:40000\n"
        f"agentkv-server: serving the Anthropic Messages API on {URL} (2 slots)\n"
        f"Point Claude Code at it:\n\n{block}\n\n"
        "INFO:     Started server process [123]\n"
    )
    assert parse_env_lines(output) == block.splitlines()


def fake_claude(tmp_path: Path) -> Path:
    script = tmp_path / "claude"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'echo "model=$ANTHROPIC_MODEL url=$ANTHROPIC_BASE_URL home=$HOME pwd=$PWD"\n'
        'echo "args=$*"\n'
        "echo to-stderr >&2\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_run_claude_sources_the_lines_in_a_fresh_project(tmp_path: Path) -> None:
    lines = claude_code_env(URL, None, ctx_per_slot=32768).splitlines()
    project = make_project(tmp_path / "demo")
    run = run_claude(
        lines,
        "say hi",
        project=project,
        home=tmp_path / "home",
        args=["--permission-mode", "acceptEdits"],
        base_url="http://127.0.0.1:1",
        claude=fake_claude(tmp_path),
    )
    assert run.returncode == 0, run.describe()
    assert not run.timed_out
    first, second = run.stdout.splitlines()
    assert first == (
        f"model=agentkv-local url=http://127.0.0.1:1 home={tmp_path / 'home'} pwd={project}"
    )
    assert second == "args=-p say hi --permission-mode acceptEdits"
    assert run.warnings() == ["to-stderr"]
    assert (project / ".git").is_dir()


def test_run_claude_kills_at_the_timeout(tmp_path: Path) -> None:
    slow = tmp_path / "claude"
    slow.write_text("#!/usr/bin/env bash\nsleep 60\n")
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    run = run_claude([], "x", project=tmp_path, home=tmp_path / "home", timeout=1, claude=slow)
    assert run.timed_out
    assert run.elapsed < 30


def test_known_diagnostic_is_not_a_warning() -> None:
    run = ClaudeRun(
        stdout="alpha\n",
        stderr='[claude-code:unrecognized_model] {"model":"agentkv-local","query_source":"sdk"}\n',
        returncode=0,
        elapsed=1.0,
        timed_out=False,
        project=Path("."),
    )
    assert run.warnings() == []
