"""One ``agentkv-server`` (its defaults) for the real-Codex tests, started as a user starts it.

The CLI comes from ``$AGENTKV_CODEX_BIN``, ``.ci/codex`` or ``codex`` on PATH. Without it (or
without the engine) the tests skip, except under ``CI`` where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._engine_fixture import locate_engine
from tests.claude._cli import AgentKVServer, server_args_from_env
from tests.codex._cli import CodexNotFoundError, find_codex


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    try:
        return find_codex()
    except CodexNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the Codex tests need the CLI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def codex_server(
    codex_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentKVServer]:
    """``agentkv-server`` with its defaults, a free port and a temporary slot directory."""
    locate_engine()  # skip (or fail under CI) without llama-server and the default model
    server = AgentKVServer(
        tmp_path_factory.mktemp("agentkv-server"), extra_args=server_args_from_env()
    )
    with server:
        yield server
