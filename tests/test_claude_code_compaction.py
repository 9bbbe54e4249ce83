"""What Claude Code 2.1.328 sends around its own auto-compaction (tests/fixtures/
claude_code_compaction, captured by ``python -m tests.claude.capture_compaction``): the facts
docs/claude-code.md states, pinned on the captured requests."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "claude_code_compaction"
SCENARIOS = (
    "turns",
    "turns_again",
    "baseline",
    "thinking",
    "retry",
    "retry_twice",
    "retry_twice_differs",
    "open_summary",
    "two_blocks",
    "two_blocks_no_summary",
    "retry_cut",
    "cut",
    "tool_call",
    "long",
)

FIRST_LINE = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
LAST_LINE = (
    "REMINDER: Do NOT call any tools. Respond with plain text only — an <analysis> block "
    "followed by a <summary> block. Tool calls will be rejected and you will fail the task."
)
#: The sentence the instruction carries only when Claude Code keeps the last reply verbatim after
#: the summary (every compaction captured but the second one inside one ``claude -p`` process).
KEPT_SENTENCE = (
    ' This summarization request itself (the text from "CRITICAL: Respond with TEXT ONLY" through '
    "the end of this message) was issued by the system to compact context, not by the user, and is "
    "not part of the conversation: do not list, quote, or describe it, or any earlier "
    "summarization request, as a user message, pending task, current work, or next step. Any user "
    'text that precedes it in the same message still counts as a user message. Any "Additional '
    'Instructions" in it still apply. All else that the summary is asked to hold stays as asked, '
    "in full."
)
#: What the second request adds when the first reply had no ``<summary>``.
RETRY_PARAGRAPH = (
    "\n\nFor this reply only: write what the instructions above ask for, with the summary inside "
    "<summary></summary> tags. Every message before those instructions, the newest one included, "
    "is conversation to summarize: do not answer it, and do not do the work that it asks for. What "
    "it says on how to summarize still holds. This paragraph is about how to write this summary. "
    "The user did not write it."
)

CONTINUED = (
    "This session is being continued from a previous conversation that ran out of context. The "
    "summary below covers the earlier portion of the conversation.\n\n<system-reminder>\n"
    "<tools-used-before-summary>{tools}</tools-used-before-summary>\n</system-reminder>\n"
    "{summary}\n\nIf you need specific details from before compaction (like exact code snippets, "
    "error messages, or content you generated), read the full transcript at: "
    "<home>/.claude/projects/-project-/{session}.jsonl\nContinue the conversation from where it "
    "left off without asking the user any further questions. Resume directly — do not acknowledge "
    'the summary, do not recap what was happening, do not preface with "I\'ll continue" or '
    "similar. Pick up the last task as if the break never happened."
)
KEPT_TRAILER = (
    "\n\nThe messages after this summary are the most recent messages from before compaction, "
    "kept verbatim. The summary was written without seeing them, so something it says has not "
    "happened yet may already have happened in them."
)


@cache
def _load(name: str) -> dict[str, Any]:
    tools = json.loads((FIXTURES / "tools.json").read_text())
    record: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    for exchange in record["exchanges"]:
        if exchange["body"].get("tools") == "tools.json":
            exchange["body"]["tools"] = tools
    return record


def load(name: str) -> dict[str, Any]:
    return copy.deepcopy(_load(name))


def exchanges(name: str) -> list[dict[str, Any]]:
    return list(load(name)["exchanges"])


def kinds(name: str) -> list[str]:
    return [e["answer"]["kind"] for e in exchanges(name)]


def compactions(name: str) -> list[int]:
    return [i for i, kind in enumerate(kinds(name)) if kind == "compaction"]


def instruction(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    return content if isinstance(content, str) else str(content[-1]["text"])


def reply_message(exchange: dict[str, Any]) -> dict[str, Any]:
    """The stub's reply as the next request should carry it: its content blocks as streamed."""
    return {"role": "assistant", "content": exchange["answer"]["message"]["content"]}


def plain(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` without ``cache_control``, a lone text block written as a string."""
    content = message["content"]
    if isinstance(content, list):
        content = [{k: v for k, v in b.items() if k != "cache_control"} for b in content]
        if len(content) == 1 and content[0]["type"] == "text" and message["role"] != "assistant":
            content = content[0]["text"]
    return {**message, "content": content}


def marked(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(message, block) of every block that carries ``cache_control``."""
    return [
        (i, j)
        for i, m in enumerate(messages)
        if isinstance(m["content"], list)
        for j, b in enumerate(m["content"])
        if "cache_control" in b
    ]


def summary_text(reply: str) -> str:
    """The reply as the summary message holds it: ``<analysis>`` dropped, ``<summary>X</summary>``
    written ``Summary:\\nX`` (X stripped), runs of blank lines made one, stripped."""
    text = re.sub(r"<analysis>.*?</analysis>", "", reply, count=1, flags=re.S)
    text = re.sub(
        r"<summary>(.*?)</summary>",
        lambda m: "Summary:\n" + m[1].strip(),
        text,
        count=1,
        flags=re.S,
    )
    return re.sub(r"\n\n+", "\n\n", text).strip()


def test_the_set_is_complete() -> None:
    assert {p.name for p in FIXTURES.glob("*.json")} == {f"{s}.json" for s in SCENARIOS} | {
        "tools.json"
    }
    for name in SCENARIOS:
        record = load(name)
        assert record["claude_code"] == "2.1.328"
        assert all(run["returncode"] == 0 for run in record["runs"])


@pytest.mark.parametrize("name", SCENARIOS)
def test_nothing_but_messages_requests(name: str) -> None:
    """No count_tokens, no HEAD, no side request around compaction: every request is a
    ``POST /v1/messages?beta=true``."""
    assert {(e["method"], e["path"], e["query"]) for e in exchanges(name)} == {
        ("POST", "/v1/messages", "beta=true")
    }


def test_when_it_compacts() -> None:
    """Every reply reported input_tokens 15,667: the second turn still runs without compaction
    (the first reply of a session never leads to one), each later turn starts with one."""
    assert kinds("turns") == ["turn", "turn", "compaction", "turn", "compaction", "turn"]
    assert [r["requests"] for r in load("turns")["runs"]] == [[0], [1], [2, 3], [4, 5]]
    assert kinds("baseline") == ["turn", "turn", "turn"]
    # inside one turn: each tool call answered above the point is followed by a compaction
    assert kinds("tool_call") == ["turn", "turn", "compaction", "turn", "compaction", "turn"]
    assert [r["requests"] for r in load("tool_call")["runs"]] == [[0], [1, 2, 3, 4, 5]]


def all_compactions() -> list[tuple[str, int]]:
    return [(name, i) for name in SCENARIOS for i in compactions(name)]


@pytest.mark.parametrize(("name", "index"), all_compactions())
def test_same_request_but_the_messages(name: str, index: int) -> None:
    """A compaction request has the previous request's headers and every field but ``messages``
    byte for byte: system, tools, model, max_tokens 4096, thinking, metadata, stream."""
    ex = exchanges(name)
    compaction, previous = ex[index], ex[index - 1]
    assert compaction["headers"] == previous["headers"]
    strip = {"messages"}
    assert {k: v for k, v in compaction["body"].items() if k not in strip} == {
        k: v for k, v in previous["body"].items() if k not in strip
    }
    assert list(compaction["body"]) == list(previous["body"])  # same keys, same order
    body = compaction["body"]
    assert body["max_tokens"] == 4096
    assert body["stream"] is True
    assert body["thinking"] == {"type": "adaptive", "display": "omitted"}
    assert "temperature" not in body
    assert len(body["tools"]) == 12


@pytest.mark.parametrize(
    ("name", "index"),
    [(n, i) for n, i in all_compactions() if kinds(n)[i - 1] == "turn"],
)
def test_previous_request_plus_reply_plus_instruction(name: str, index: int) -> None:
    """messages[:-1] is the previous request's messages and the reply as streamed; only the
    ``cache_control`` mark moves (from the previous last message to the reply's last block, and
    the previous last message, a lone text block, goes back to a string)."""
    ex = exchanges(name)
    compaction, previous = ex[index]["body"]["messages"], ex[index - 1]["body"]["messages"]
    reply = reply_message(ex[index - 1])
    assert [plain(m) for m in compaction[:-1]] == [plain(m) for m in [*previous, reply]]
    # byte for byte, but the mark
    assert compaction[: len(previous) - 1] == previous[:-1]
    assert compaction[len(previous)] == {
        "role": "assistant",
        "content": [
            *reply["content"][:-1],
            {**reply["content"][-1], "cache_control": {"type": "ephemeral"}},
        ],
    }
    assert marked(previous) == [(len(previous) - 1, len(previous[-1]["content"]) - 1)]
    assert marked(compaction) == [(len(previous), len(reply["content"]) - 1)]


def test_start_of_turn_leaves_out_the_new_prompt() -> None:
    """Compacting at the start of a turn, the turn's own prompt is not in the request: the
    instruction is a user message of its own, a plain string."""
    ex = exchanges("turns")
    for index, prompt in ((2, "gamma"), (4, "delta")):
        body = ex[index]["body"]
        assert prompt not in json.dumps(body)
        assert body["messages"][-1] == {"role": "user", "content": instruction(body)}
    assert ex[3]["body"]["messages"][3]["content"][-1]["text"].endswith("gamma")


@pytest.mark.parametrize(("name", "index"), [("tool_call", 2), ("tool_call", 4), ("long", 6)])
def test_between_tool_calls_the_result_comes_first(name: str, index: int) -> None:
    """Compacting between tool calls, the last user message holds the tool_result, then the
    instruction as a text block: the request cannot exist before the tool has run."""
    ex = exchanges(name)
    call = ex[index - 1]["answer"]["message"]["content"][-1]
    last = ex[index]["body"]["messages"][-1]
    assert last["role"] == "user"
    assert [b["type"] for b in last["content"]] == ["tool_result", "text"]
    assert last["content"][0]["tool_use_id"] == call["id"]
    assert last["content"][0]["content"] == "1\t# demo\n2\t"


def test_the_instruction() -> None:
    """The same text in every first compaction of a process, in every session and project: no
    date, id or path in it. The second compaction inside one process lacks one sentence; the
    retry adds a paragraph."""
    texts = {instruction(exchanges(n)[i]["body"]) for n, i in all_compactions()}
    base = instruction(exchanges("turns")[2]["body"])
    assert len(base) == 6912
    assert base.startswith(FIRST_LINE + "\n\n- Do NOT use Read, Bash, Grep, Glob, Edit, Write")
    assert base.endswith("\n\n\n" + LAST_LINE)
    assert KEPT_SENTENCE in base
    short = base.replace(KEPT_SENTENCE, "")
    assert texts == {base, short, base + RETRY_PARAGRAPH}
    for name in ("turns", "turns_again", "thinking", "long"):
        assert {instruction(exchanges(name)[i]["body"]) for i in compactions(name)} == {base}
    assert instruction(exchanges("tool_call")[2]["body"]) == base
    assert instruction(exchanges("tool_call")[4]["body"]) == short
    for text in texts:
        assert not re.search(r"<project>|<home>|\d{4}-\d\d-\d\d|[0-9a-f]{8}-[0-9a-f]{4}", text)


def test_the_retry_repeats_the_request_with_a_paragraph_more() -> None:
    ex = exchanges("retry")
    assert kinds("retry") == ["turn", "turn", "compaction", "compaction", "turn"]
    first, second = ex[2], ex[3]
    assert "<summary>" not in first["answer"]["message"]["content"][0]["text"]
    assert second["headers"] == first["headers"]  # x-stainless-retry-count stays 0
    assert second["headers"]["x-stainless-retry-count"] == "0"
    assert second["body"]["messages"][:-1] == first["body"]["messages"][:-1]
    assert instruction(second["body"]) == instruction(first["body"]) + RETRY_PARAGRAPH
    assert {k: v for k, v in second["body"].items() if k != "messages"} == {
        k: v for k, v in first["body"].items() if k != "messages"
    }


def test_thinking_goes_in_as_streamed() -> None:
    ex = exchanges("thinking")
    reply = ex[1]["answer"]["message"]["content"]
    assert [b["type"] for b in reply] == ["thinking", "text"]
    sent = ex[2]["body"]["messages"][-2]["content"]
    assert sent[0] == reply[0]  # thinking text and signature unchanged, no mark
    assert sent[1] == {**reply[1], "cache_control": {"type": "ephemeral"}}


def continued(name: str, index: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the session's first request, the compaction exchange, the request after it)."""
    ex = exchanges(name)
    assert ex[index]["answer"]["kind"] == "compaction"
    assert ex[index + 1]["answer"]["kind"] == "turn"
    return ex[0]["body"], ex[index], ex[index + 1]


@pytest.mark.parametrize(
    ("name", "index", "tools"),
    [
        ("turns", 2, ""),
        ("turns", 4, ""),
        ("turns_again", 2, ""),
        ("thinking", 2, ""),
        ("retry", 3, ""),
        ("tool_call", 2, "Read"),
        ("long", 6, "Read"),
        ("long", 8, "Read"),
    ],
)
def test_the_request_after_the_compaction(name: str, index: int, tools: str) -> None:
    """System (but the billing line) and tools stay; the first message is the session's git-status
    block (one newline more) and the summary text; then "Today's date …" as a system message and
    the last reply before the compaction, kept as it was sent."""
    first, compaction, after = continued(name, index)
    body = after["body"]
    assert body["system"][1:] == first["system"][1:]
    assert body["system"][0]["text"] != first["system"][0]["text"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header: cc_version=2.1.328.")
    assert body["tools"] == first["tools"]
    assert {k: v for k, v in body.items() if k not in ("system", "messages")} == {
        k: v for k, v in first.items() if k not in ("system", "messages")
    }
    git_status = first["messages"][0]["content"][0]["text"]
    summary = summary_text(compaction["answer"]["message"]["content"][0]["text"])
    session = compaction["headers"]["x-claude-code-session-id"]
    head = body["messages"][0]
    assert head == {
        "role": "user",
        "content": [
            {"type": "text", "text": git_status + "\n"},
            {
                "type": "text",
                "text": CONTINUED.format(tools=tools, summary=summary, session=session)
                + KEPT_TRAILER,
            },
        ],
    }
    assert re.fullmatch(
        r"\{'role': 'system', 'content': \"Today's date is \d{4}-\d\d-\d\d\.\"\}",
        repr(body["messages"][1]),
    )
    kept = compaction["body"]["messages"][-2]
    assert (
        body["messages"][2]
        == plain(kept)
        == {
            "role": "assistant",
            "content": [
                {k: v for k, v in b.items() if k != "cache_control"} for b in kept["content"]
            ],
        }
    )


def test_the_second_compaction_in_one_process_keeps_no_reply() -> None:
    """Without a kept reply: no trailer, no date message; the tool's file read comes back as
    reminders and the summary goes last in the user message."""
    first, compaction, after = continued("tool_call", 4)
    messages = after["body"]["messages"]
    assert messages[0]["content"].startswith("<system-reminder>\nCalled the Read tool")
    texts = [b["text"] for b in messages[1]["content"]]
    assert texts[0].startswith("<system-reminder>\nResult of calling the Read tool:")
    assert texts[1] == first["messages"][0]["content"][0]["text"]  # git status, as first sent
    summary = summary_text(compaction["answer"]["message"]["content"][0]["text"])
    session = compaction["headers"]["x-claude-code-session-id"]
    assert texts[-1] == CONTINUED.format(tools="Read", summary=summary, session=session)
    assert [m["role"] for m in messages] == ["user", "user", "system"]


@pytest.mark.parametrize(
    ("name", "index", "kept"),
    [("turns", 2, True), ("turns", 4, True), ("long", 8, True), ("tool_call", 4, False)],
)
def test_the_environment_note_comes_back_reordered(name: str, index: int, kept: bool) -> None:
    """The last message after a compaction holds the first request's environment note, its parts
    reordered; with a reply kept, its date went to ``messages[1]``."""
    first, _, after = continued(name, index)
    parts = first["messages"][1]["content"][0]["text"].split("\n\n")
    assert parts[0].startswith("# Environment\n")
    assert parts[1] == "You are powered by the model agentkv-local."
    assert parts[-1].startswith("Today's date is ")
    last = after["body"]["messages"][-1]
    assert last["role"] == "system"
    moved = parts[2:-1] + parts[:2] + ([] if kept else parts[-1:])
    assert last["content"] == [
        {"type": "text", "text": "\n\n".join(moved), "cache_control": {"type": "ephemeral"}}
    ]
    if kept:
        assert after["body"]["messages"][1] == {"role": "system", "content": parts[-1]}


def test_summary_text() -> None:
    reply = "<analysis>\nA\n</analysis>\n\n\n<summary>\n 1. B\n\n\n2. C \n</summary>\n"
    assert summary_text(reply) == "Summary:\n1. B\n\n2. C"
