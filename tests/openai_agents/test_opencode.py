"""The real OpenCode CLI (``opencode run``), a Chat Completions agent, through ``agentkv-server``.

Set up as docs/openai-agents.md says. Over a scripted engine it must print the engine's answer
(seconds); on the real engine it must finish one turn with an answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.claude._cli import AgentKVServer
from tests.fakes import FakeLlama
from tests.openai_agents._engine import SCRIPTED_ARGS, engine_over_http
from tests.openai_agents._opencode import run_opencode

pytestmark = pytest.mark.opencode

#: A one-word answer, cold engine included, on 2 cores; AGENTKV_ANSWER_BOUND_S raises it on a
#: machine shared with other work.
ANSWER_BOUND_S = int(os.environ.get("AGENTKV_ANSWER_BOUND_S", "600"))


@pytest.mark.timeout(300)
def test_opencode_answers_through_agentkv(opencode_bin: Path, tmp_path: Path) -> None:
    """OpenCode's requests reach the engine through /v1/chat/completions as its agent, and the
    engine's reply is OpenCode's answer."""
    fake = FakeLlama(reply="alpha")
    with (
        engine_over_http(fake) as engine,
        AgentKVServer(
            tmp_path / "server", extra_args=["--upstream", engine, *SCRIPTED_ARGS]
        ) as server,
    ):
        run = run_opencode(
            server.url,
            "Reply with the single word: alpha",
            project=tmp_path / "project",
            home=tmp_path / "home",
            timeout=180,
            agent="opencode-1",
            opencode=opencode_bin,
        )
        recent = server.table()["recent"]
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert run.answer() == "alpha", run.describe()
    assert recent and all(r["agent"] == "opencode-1" and r["status"] == "ok" for r in recent)
    assert any("Reply with the single word: alpha" in str(r["messages"]) for r in fake.requests)


@pytest.mark.engine
@pytest.mark.timeout(ANSWER_BOUND_S + 120)
def test_opencode_does_one_turn_on_the_real_engine(
    agents_server: AgentKVServer, opencode_bin: Path, tmp_path: Path
) -> None:
    """One ``opencode run`` turn with the default model ends with an answer."""
    run = run_opencode(
        agents_server.url,
        "Reply with the single word: alpha",
        project=tmp_path / "project",
        home=tmp_path / "home",
        timeout=ANSWER_BOUND_S,
        opencode=opencode_bin,
    )
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert run.stdout.strip(), run.describe()
    print(f"\nopencode: answered {run.stdout.strip()[:80]!r} in {run.elapsed:.1f} s")
