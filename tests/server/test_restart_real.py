"""A restart on a real llama-server: every agent's last turn is in the prefix store afterwards, so
its next turn computes only its own new tokens (llama-server's own count says so)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.store import EntryKind
from tests.server.conftest import start_live
from tests.server.test_preemption_real import computed, post

pytestmark = pytest.mark.engine

# About 900 tokens of the agent's own context.
NOTES = "\n".join(
    f"Note {i}: the service on port {8000 + i} answers within {i + 3} ms." for i in range(60)
)


def turns(replies: list[str], questions: list[str]) -> list[dict[str, Any]]:
    """The conversation: the notes, then each question and the reply it got."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": NOTES + "\n" + questions[0]}]
    for reply, question in zip(replies, questions[1:], strict=False):
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": question},
        ]
    return messages


def text(reply: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in reply["content"]) or "(no text)"


def test_after_a_restart_a_follow_up_computes_only_its_new_tokens(tmp_path: Path) -> None:
    """Turn 1, then a follow-up a few dozen tokens long (under --park-min); a clean stop saves
    the follow-up's whole context; after the restart, turn 3 computes only what is new."""
    questions = [
        "Which port answers fastest?",
        "And the slowest?",
        "Name one port in between.",
    ]
    replies: list[str] = []
    with start_live(tmp_path) as live:
        for n in (1, 2):
            reply = post(live, "restart-a", 1, turns(replies, questions[:n]), max_tokens=16)
            replies.append(text(reply))
        held = max(row.tokens for row in live.runtime.snapshot().slots)
    with start_live(tmp_path) as live:
        (entry,) = [
            e
            for e in live.runtime.store.index.entries()
            if e.kind is EntryKind.CONTEXT  # type: ignore[union-attr]
        ]
        assert entry.agent == "restart-a" and entry.n_tokens >= held
        before = computed(live)
        reply = post(live, "restart-a", 1, turns(replies, questions), max_tokens=16)
        engine_computed = computed(live) - before
        record = live.runtime.records()[-1]
        assert record.source == "store"
        new_tokens = record.prompt_tokens - entry.n_tokens
        assert 0 < new_tokens < 64
        # The saved context ends with the reply's last token, which the next prompt writes
        # again in its own terms: at most a couple of tokens past the new ones.
        assert engine_computed <= new_tokens + 2, (engine_computed, new_tokens)
        assert reply["usage"]["cache_read_input_tokens"] >= entry.n_tokens - 2
        headers = {"authorization": f"Bearer {live.engine_key}"} if live.engine_key else {}
        assert httpx.get(f"{live.engine_url}/health", headers=headers, timeout=30).is_success
