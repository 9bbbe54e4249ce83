"""The real OpenAI-API agents (Codex, OpenCode) against ``agentkv-server``, started as a user would.

The CLIs come from ``$AGENTKV_CODEX_BIN`` / ``$AGENTKV_OPENCODE_BIN``, from ``.ci/codex`` /
``.ci/opencode`` (what ``.ci/run`` installs), or from PATH. Without them (or without the engine) the
tests skip, except under ``CI`` where they fail. The tests on the real engine share one server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._engine_fixture import locate_engine
from tests.claude._cli import AgentKVServer, server_args_from_env
from tests.openai_agents._codex import CodexNotFoundError, find_codex
from tests.openai_agents._opencode import OpenCodeNotFoundError, find_opencode


def _required(found: Path | None, why: str) -> Path:
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    try:
        return find_codex()
    except CodexNotFoundError as exc:
        return _required(None, f"the Codex tests need the CLI: {exc}")


@pytest.fixture(scope="session")
def opencode_bin() -> Path:
    try:
        return find_opencode()
    except OpenCodeNotFoundError as exc:
        return _required(None, f"the OpenCode tests need the CLI: {exc}")


@pytest.fixture(scope="session")
def agents_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentKVServer]:
    """``agentkv-server`` with its defaults (it launches the engine), a free port and a temporary
    slot directory; shared by every real-engine test here."""
    locate_engine()  # skip (or fail under CI) without llama-server and the default model
    root = tmp_path_factory.mktemp("agentkv-server")
    with AgentKVServer(root, extra_args=server_args_from_env()) as server:
        yield server
