"""The captured Claude Code 2.1.328 requests (tests/fixtures/claude_code): sanitised, accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agentkv.translate import BILLING_HEADER_PREFIX, MessagesTranslator

FIXTURES = Path(__file__).parent / "fixtures" / "claude_code"
FILES = sorted(FIXTURES.glob("*.json"))
# Paths of the machine the captures ran on must not be in them: only the neutral project
# directories and the neutral HOME.
MACHINE_PATH = re.compile(r"/work/|/root/|/tmp/(?!agentkv-demo\b|agentkv-other\b)")


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
