"""The real Codex CLI (``codex exec``) against ``agentkv-server`` with the default model.

Codex is set up with exactly the ``config.toml`` lines the server printed. Its first request is
about 10K tokens (about 140 s of prefill cold on 2 cores); the second session reuses that prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.claude._cli import AgentKVServer
from tests.openai_agents._codex import codex_config, run_codex

pytestmark = [pytest.mark.codex, pytest.mark.engine]

#: A one-word answer, cold engine included, on 2 cores; AGENTKV_ANSWER_BOUND_S raises it on a
#: machine shared with other work.
ANSWER_BOUND_S = int(os.environ.get("AGENTKV_ANSWER_BOUND_S", "600"))
PROMPT = "Reply with the single word: {word}"


def codex_requests(server: AgentKVServer) -> list[dict[str, object]]:
    return [r for r in server.table()["recent"] if r["agent"] != "anonymous"]


@pytest.mark.timeout(2 * ANSWER_BOUND_S + 120)
def test_printed_config_gives_one_word_answers_and_a_warm_second_session(
    agents_server: AgentKVServer, codex_bin: Path, tmp_path: Path
) -> None:
    """Two fresh ``codex exec`` sessions in one project both answer; the second reuses the
    first one's prompt from the cache instead of computing it again."""
    config, env = codex_config(agents_server.log())
    assert 'wire_api = "responses"' in config and "model_context_window" in config, config
    project = tmp_path / "project"
    runs = []
    for word in ("alpha", "beta"):
        run = run_codex(
            config,
            env,
            PROMPT.format(word=word),
            project=project,
            home=tmp_path / "codex-home",  # one user: one CODEX_HOME
            timeout=ANSWER_BOUND_S,
            codex=codex_bin,
        )
        assert not run.timed_out and run.returncode == 0, run.describe()
        assert run.answer() == word, run.describe()
        assert run.warnings() == [], run.describe()
        runs.append(run)
    first, second = codex_requests(agents_server)[-2:]
    assert first["agent"] != second["agent"]  # two sessions, two agents
    # The second session's prompt was found cached almost whole.
    assert int(second["cached_tokens"]) >= 0.8 * int(second["prompt_tokens"]), (first, second)
    print(
        f"\ncodex: first session {runs[0].elapsed:.1f} s, second {runs[1].elapsed:.1f} s "
        f"({runs[1].elapsed / runs[0].elapsed:.2f}x); second prompt {second['prompt_tokens']} "
        f"tokens, {second['cached_tokens']} cached"
    )
