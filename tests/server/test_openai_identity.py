"""Who an OpenAI-API request belongs to: Codex's headers, X-Agent-Id, then the body's keys."""

from __future__ import annotations

import json

from agentkv_server.identity import CodexTurn, codex_subagent, codex_turn, openai_agent_identity

TURN = {
    "session_id": "sess-1",
    "thread_id": "thread-2",
    "agent_name": "/root/worker",
    "turn_id": "turn-3",
    "request_kind": "turn",
    "installation_id": "ignored",
}
CODEX = {
    "x-codex-turn-metadata": json.dumps(TURN),
    "session-id": "sess-1",
    "thread-id": "thread-header",
}


def test_codex_turn_metadata_is_read() -> None:
    """Codex's JSON header gives its session, thread, agent name, turn and request kind."""
    assert codex_turn(CODEX) == CodexTurn(
        session_id="sess-1",
        thread_id="thread-2",
        agent_name="/root/worker",
        turn_id="turn-3",
        request_kind="turn",
    )


def test_codex_turn_metadata_that_is_not_json_is_ignored() -> None:
    assert codex_turn({"x-codex-turn-metadata": "{not json"}) is None
    assert codex_turn({"x-codex-turn-metadata": "[1]"}) is None
    assert codex_turn({"x-codex-turn-metadata": "x" * 20000}) is None
    assert codex_turn({}) is None


def test_order_of_sources() -> None:
    """X-Agent-Id, Codex's thread, its session, prompt_cache_key, user, the address."""
    body = {"prompt_cache_key": "pck", "user": "u"}
    assert openai_agent_identity({**CODEX, "x-agent-id": "coder"}, body, "1.2.3.4") == "coder"
    assert openai_agent_identity(CODEX, body, "1.2.3.4") == "thread-2"
    assert openai_agent_identity({"thread-id": "t", "session-id": "s"}, body, None) == "t"
    assert openai_agent_identity({"session-id": "s"}, body, None) == "s"
    assert openai_agent_identity({}, body, None) == "pck"
    assert openai_agent_identity({}, {"user": "u"}, None) == "u"
    assert openai_agent_identity({}, {"user": 5}, "1.2.3.4") == "1.2.3.4"
    assert openai_agent_identity({}, {}, None) == "anonymous"


def test_identities_are_cleaned() -> None:
    """Control characters go, long ids become their digest form, empty ones do not count."""
    assert openai_agent_identity({"thread-id": "a\x1b[31mb\n"}, {}, None) == "a[31mb"
    long = openai_agent_identity({}, {"prompt_cache_key": "k" * 500}, None)
    assert len(long) < 100 and "…#" in long
    assert openai_agent_identity({"x-agent-id": "\n"}, {"user": "u"}, None) == "u"


def test_a_codex_sub_agent_is_an_agent_of_its_own() -> None:
    """Codex 0.171.0's headers for a spawned sub-agent (captured): the same session, a thread of
    its own, the parent's thread named."""
    metadata = {
        "session_id": "01a23020-bba6",
        "thread_id": "01a23020-bd57",
        "agent_name": "/root",
        "request_kind": "turn",
        "parent_thread_id": "01a23020-bba6",
        "subagent_kind": "thread_spawn",
        "thread_source": "subagent",
    }
    headers = {
        "x-codex-turn-metadata": json.dumps(metadata),
        "x-codex-parent-thread-id": "01a23020-bba6",
        "x-openai-subagent": "collab_spawn",
        "session-id": "01a23020-bba6",
        "thread-id": "01a23020-bd57",
    }
    turn = codex_turn(headers)
    assert turn is not None
    assert (turn.parent_thread_id, turn.subagent_kind) == ("01a23020-bba6", "thread_spawn")
    assert openai_agent_identity(headers, {"prompt_cache_key": "01a23020-bba6"}, None) == (
        "01a23020-bd57"
    )
    assert codex_subagent(headers) == ("01a23020-bba6", "01a23020-bd57")
    assert codex_subagent({**headers, "x-agent-id": "codex-main"}) == (
        "codex-main",
        "01a23020-bd57",
    )


def test_a_codex_main_thread_is_no_sub_agent() -> None:
    """Codex's main thread (no parent, or itself as parent) and other clients are roots."""
    main = {"session_id": "s", "thread_id": "s", "agent_name": "/root"}
    assert codex_subagent({"x-codex-turn-metadata": json.dumps(main)}) is None
    itself = {**main, "parent_thread_id": "s"}
    assert codex_subagent({"x-codex-turn-metadata": json.dumps(itself)}) is None
    assert codex_subagent({"thread-id": "t"}) is None
