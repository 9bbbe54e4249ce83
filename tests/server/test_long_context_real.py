"""Long sessions on the real default model: compaction and "prompt is too long"."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest

from agentkv.snapshot import CompactionRow, RequestView
from tests.server.conftest import Live

pytestmark = pytest.mark.engine

MODEL = "agentkv-local"
AGENT = "long-talker"


@pytest.fixture
def low_water(live: Live) -> Iterator[None]:
    """Compact past 700 tokens and keep 4 recent messages, for this test only."""
    runtime = live.runtime
    compactor, admission = runtime.compactor, runtime.admission
    old = runtime.config, compactor.keep_recent, compactor.summary_tokens
    # Admission decides when to compact, from the config it was given.
    runtime.config = admission.config = attrs.evolve(old[0], compact_at=700)
    compactor.keep_recent, compactor.summary_tokens = 4, 120
    try:
        yield
    finally:
        runtime.config, compactor.keep_recent, compactor.summary_tokens = old
        admission.config = old[0]


def history(turns: int) -> list[dict[str, Any]]:
    """A scripted agent session: each turn reads a file and gets its (long) contents back."""
    messages: list[dict[str, Any]] = []
    for n in range(turns):
        tool_id = f"toolu_read{n:02d}"
        body = "\n".join(
            f"def helper_{n}_{i}(x):\n    return x * {i} + {n}  # step {i} of module {n}"
            for i in range(8)
        )
        messages += [
            {"role": "user", "content": f"Open module_{n}.py and tell me what it does."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Reading module_{n}.py."},
                    {
                        "type": "tool_use",
                        "id": tool_id,
                        "name": "Read",
                        "input": {"file_path": f"module_{n}.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": body}],
            },
            {"role": "assistant", "content": f"module_{n}.py defines eight small helpers."},
        ]
    return messages


READ_TOOL = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
    },
}


def ask(live: Live, messages: list[dict[str, Any]], **headers: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": 12,
        "temperature": 0,
        "system": "You are a coding agent. Answer briefly.",
        "tools": [READ_TOOL],
        "messages": messages,
    }
    return httpx.post(f"{live.url}/v1/messages", json=body, headers=headers, timeout=600)


def record(live: Live, agent: str) -> RequestView:
    return [r for r in live.runtime.snapshot().recent if r.agent == agent][-1]


def test_compaction_runs_in_the_background_and_the_next_turn_hits_the_new_prefix(
    live: Live, low_water: None
) -> None:
    """Past the high-water mark a P3 compaction runs, a P0 request is not delayed by it, and the
    agent's next turn is served from the compacted prefix and still sees its recent turns."""
    messages = [
        *history(4),
        {"role": "user", "content": "The release code name is HELIOTROPE. Remember it."},
    ]
    first = ask(live, messages, **{"x-agent-id": AGENT})
    assert first.status_code == 200, first.text
    before = first.json()["usage"]
    tokens_before = before["input_tokens"] + before["cache_read_input_tokens"]
    assert tokens_before > 700

    # The compaction is under way at priority 3; an urgent request from another agent goes first.
    assert live.runtime.compactor.store.pending(AGENT)
    urgent: dict[str, Any] = {}

    def coordinator() -> None:
        urgent["r"] = ask(
            live,
            [{"role": "user", "content": "Say ok."}],
            **{"x-agent-id": "coordinator", "x-agent-priority": "0"},
        )

    t = threading.Thread(target=coordinator)
    t.start()
    t.join(timeout=300)
    assert urgent["r"].status_code == 200
    assert record(live, "coordinator").queued_s < 1.0

    deadline = time.monotonic() + 300
    while live.runtime.compactor.store.pending(AGENT):
        assert time.monotonic() < deadline, "compaction did not finish"
        time.sleep(0.5)
    rows = [r for r in live.runtime.compactor.store.snapshot() if r.agent == AGENT]
    assert len(rows) == 1 and isinstance(rows[0], CompactionRow) and rows[0].saved_tokens > 0

    reply = first.json()["content"][0]["text"] if first.json()["content"] else "Noted."
    follow_up = [
        *messages,
        {"role": "assistant", "content": reply or "Noted."},
        {"role": "user", "content": "What is the release code name? Reply with it only."},
    ]
    second = ask(live, follow_up, **{"x-agent-id": AGENT})
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert total < tokens_before  # the engine saw the summary, not the whole history
    assert record(live, AGENT).source == "slot"
    assert usage["cache_read_input_tokens"] >= 0.5 * total
    answer = "".join(b.get("text", "") for b in second.json()["content"])
    assert "HELIOTROPE" in answer.upper()


def test_oversize_prompt_gets_prompt_is_too_long(live: Live) -> None:
    """A prompt larger than a slot's context is refused with the exact Anthropic text."""
    before = len(live.runtime.snapshot().recent)
    huge = " ".join(f"token{i}" for i in range(6000))
    r = ask(live, [{"role": "user", "content": huge}], **{"x-agent-id": "oversize"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["message"])
    assert found, err["message"]
    assert int(found.group(1)) > int(found.group(2))
    assert len(live.runtime.snapshot().recent) == before  # never sent to the engine
