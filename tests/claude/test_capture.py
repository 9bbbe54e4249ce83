"""The pinned CLI's first requests, captured fresh: nothing of the project before the session facts.

No model and no ``agentkv-server``: ``CannedServer`` answers, so each capture takes seconds. The
same check as ``tests/test_claude_code_fixtures.py`` runs on the stored captures; this one runs on
whatever the installed CLI sends today, so a new Claude Code version that adds a project-specific
string ahead of the session facts fails here as soon as the pin moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.claude._cli import CLAUDE_CODE_VERSION, make_project
from tests.claude.capture import AGENT_CALL, CannedServer, capture
from tests.test_claude_code_fixtures import project_independent_head, project_strings

pytestmark = [pytest.mark.claude, pytest.mark.engine]

PROMPT = "Reply with the single word: alpha"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("subagent", [False, True], ids=["agent", "subagent"])
def test_fresh_captures_share_everything_before_the_session_facts(
    claude_bin: Path, tmp_path: Path, subagent: bool
) -> None:
    # Names no prompt would contain by chance: the check looks for them as substrings.
    plain = tmp_path / "plain-notes-xq"
    plain.mkdir()
    cases = [
        (make_project(tmp_path / "project-a-xq"), tmp_path / "home" / "demo", {}),
        (make_project(tmp_path / "project-b-xq"), tmp_path / "home" / "demo", {}),
        (plain, tmp_path / "home" / "alice", {"USER": "alice"}),
    ]
    records = []
    with CannedServer(agent_call=AGENT_CALL if subagent else None) as server:
        for project, home, env in cases:
            sent = capture(server, PROMPT, project=project, home=home, claude=claude_bin, env=env)
            wanted = [c for c in sent if c.is_subagent] if subagent else sent[:1]
            assert wanted, f"no request from the CLI in {project}"
            assert CLAUDE_CODE_VERSION in wanted[0].headers.get("user-agent", "")
            records.append({"cwd": str(project), "home": str(home), "body": wanted[0].body})
    heads = {project_independent_head(record["body"]) for record in records}
    assert len(heads) == 1, "the prompts differ before the session facts"
    (head,) = heads
    for record in records:
        for string in project_strings(record):
            assert string not in head, (record["cwd"], string)
