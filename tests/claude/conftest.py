"""One ``agentkv-server`` for all real-CLI tests, started as a user starts it.

The CLI comes from ``$AGENTKV_CLAUDE_BIN`` or ``claude`` on PATH. Without it (or without the engine)
the tests skip, except under ``CI`` where they fail, so a broken install cannot pass CI silently.
``$AGENTKV_CLAUDE_SERVER_ARGS`` adds flags to the server (empty: its defaults).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._engine_fixture import locate_engine
from tests.claude._cli import (
    AgentKVServer,
    ClaudeNotFoundError,
    find_claude,
    server_args_from_env,
)


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    try:
        return find_claude()
    except ClaudeNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the Claude Code tests need the CLI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def agentkv_server(
    claude_bin: Path, claude_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentKVServer]:
    """``agentkv-server`` with its defaults, a free port and a temporary slot directory; Claude
    Code's configuration directory is the tests' (a user running both as one account has that
    without saying it)."""
    locate_engine()  # skip (or fail under CI) without llama-server and the default model
    root = tmp_path_factory.mktemp("agentkv-server")
    server = AgentKVServer(
        root,
        extra_args=server_args_from_env(),
        env={"CLAUDE_CONFIG_DIR": str(claude_home / ".claude")},
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def claude_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Claude Code's HOME for the whole session: nothing from the developer's own settings."""
    return tmp_path_factory.mktemp("claude-home")
