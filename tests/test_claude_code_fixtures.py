"""The captured Claude Code 2.1.328 requests (tests/fixtures/claude_code): sanitised, accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agentkv.layout import SESSION_HEADER
from agentkv.translate import BILLING_HEADER_PREFIX, MessagesTranslator

FIXTURES = Path(__file__).parent / "fixtures" / "claude_code"
FILES = sorted(FIXTURES.glob("*.json"))
# Paths of the machine the captures ran on must not be in them: only the neutral project
# directories and the neutral HOME.
MACHINE_PATH = re.compile(
    r"/work/|/root/|/tmp/(?!agentkv-(?:demo|other|notes|sub-demo|sub-other|tty-demo|tty-other)\b)"
)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def test_the_set_is_complete() -> None:
    assert {f.name for f in FILES} == {
        "a_one_word.json",
        "b_file_task_1.json",
        "b_file_task_2.json",
        "b_file_task_3.json",
        "c_same_project_1.json",
        "c_same_project_2.json",
        "d_other_project.json",
    }


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_fixture_is_sanitised(path: Path) -> None:
    text = path.read_text()
    assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text)
    data = json.loads(text)
    assert data["claude_code"] == "2.1.328"
    assert data["path"] == "/v1/messages"
    user = json.loads(data["body"]["metadata"]["user_id"])
    assert user["device_id"] == "0" * 64
    assert "host" not in data["headers"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_fixture_translates(path: Path) -> None:
    body = load(path.name)["body"]
    request = MessagesTranslator().translate(body)
    assert request.stream is True
    assert request.body["max_tokens"] == 4096
    # The billing line never reaches the engine: its suffix changes with the first prompt.
    assert BILLING_HEADER_PREFIX not in json.dumps(request.body["messages"][0])


def test_same_project_sessions_differ_only_from_the_users_words() -> None:
    a, c1, c2 = (
        load(n)["body"]
        for n in ("a_one_word.json", "c_same_project_1.json", "c_same_project_2.json")
    )
    for other in (c1, c2):
        assert other["system"] == a["system"]
        assert other["tools"] == a["tools"]
        first_a, first_o = a["messages"][0]["content"], other["messages"][0]["content"]
        assert first_a[:-1] == first_o[:-1]
        assert first_a[-1]["text"] != first_o[-1]["text"]
        assert a["messages"][1] == other["messages"][1]  # the environment note


def test_other_project_differs_inside_the_system_prompt() -> None:
    a, d = load("a_one_word.json")["body"], load("d_other_project.json")["body"]
    assert a["tools"] == d["tools"]
    assert a["system"][2] != d["system"][2]
    assert "-tmp-agentkv-other/memory/" in d["system"][2]["text"]


# -- what depends on the project ---------------------------------------------------------------

PROJECTS = FIXTURES / "projects"
CAPTURES = sorted(PROJECTS.glob("*.json"))


def project_independent_head(body: dict[str, Any]) -> str:
    """What agentkv sends for ``body`` up to the session's facts: the system prompt, the tools
    and the first turn's shared context. It must be the same in every project."""
    engine = MessagesTranslator().translate(body).body
    system, first = engine["messages"][0], engine["messages"][1]
    assert system["role"] == "system" and first["role"] == "user"
    assert SESSION_HEADER in first["content"], "the environment note was not recognised"
    shared = first["content"].split("<system-reminder>\n" + SESSION_HEADER)[0]
    return json.dumps([system, engine.get("tools"), shared], ensure_ascii=False)


def project_strings(record: dict[str, Any]) -> list[str]:
    """The strings that name one capture's project, user and machine."""
    cwd, home = record["cwd"], record["home"]
    note = next(m for m in record["body"]["messages"] if m["role"] == "system")["content"][0][
        "text"
    ]
    os_version = re.search(r"OS Version: (.+)", note)
    strings = [cwd, cwd.replace("/", "-"), home, Path(cwd).name]
    if os_version:
        strings.append(os_version.group(1))
    return strings


def test_the_captures_cover_directories_users_shells_sub_agents_and_the_interactive_cli() -> None:
    records = {p.stem: json.loads(p.read_text()) for p in CAPTURES}
    assert set(records) == {
        "git_demo",
        "git_other",
        "plain_dir",
        "other_user",
        "other_shell",
        "subagent_git_demo",
        "subagent_git_other",
        "interactive_git_demo",
        "interactive_git_other",
    }
    for name, record in records.items():
        assert record["claude_code"] == "2.1.328"
        assert not MACHINE_PATH.search(json.dumps(record)), name
        first = record["body"]["system"][0]["text"]
        assert ("cc_is_subagent=true" in first) == name.startswith("subagent_"), name


def kind_of(path: Path) -> str:
    """``-p`` agent, sub-agent or interactive CLI: each has a system prompt of its own."""
    return path.stem.split("_")[0] if path.stem.startswith(("subagent_", "interactive_")) else "p"


@pytest.mark.parametrize("kind", ["p", "subagent", "interactive"])
def test_no_project_string_before_the_session_facts(kind: str) -> None:
    """Every capture, in every directory, sends the same head up to its session facts, and no
    string of its project, user or machine appears in it.

    This fails when a Claude Code version adds a project-specific string to its system prompt,
    its tools or its shared context: capture its requests again (``python -m
    tests.claude.capture``) and teach agentkv.layout the new string, or the head is no longer
    shared between projects.
    """
    records = [json.loads(p.read_text()) for p in CAPTURES if kind_of(p) == kind]
    assert len(records) >= 2
    heads = {project_independent_head(r["body"]) for r in records}
    assert len(heads) == 1
    (head,) = heads
    for record in records:
        for string in project_strings(record):
            assert string not in head, (record["cwd"], string)


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_capture_keeps_every_fact_after_the_layout(path: Path) -> None:
    """The layout moves the project's lines but drops none of them."""
    record = json.loads(path.read_text())
    body = record["body"]
    sent = json.dumps(MessagesTranslator().translate(body).body["messages"], ensure_ascii=False)
    original = json.dumps([body["system"], body["messages"]], ensure_ascii=False)
    for string in project_strings(record):
        escaped = json.dumps(string)[1:-1]
        assert (escaped in original) <= (escaped in sent), string
    note = next(m for m in body["messages"] if m["role"] == "system")["content"][0]["text"]
    for line in note.split("\n"):
        assert json.dumps(line, ensure_ascii=False)[1:-1] in sent, line
