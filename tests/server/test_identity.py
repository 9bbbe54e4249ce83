"""Agent identity and priority: every source in its order, and ids cleaned before use."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from agentkv import InvalidRequestError
from agentkv_server.identity import (
    MAX_AGENT_ID,
    MAX_SUBAGENT_ID,
    agent_identity,
    agent_priority,
    clean_agent_id,
    subagent_id,
)

SESSION = "0b9a3f52-6c1d-4e8a-9f27-3d5b8c1e7a40"
USER_ID_JSON = json.dumps({"device_id": "d" * 32, "account_uuid": "", "session_id": SESSION})
USER_ID_LEGACY = f"user_{'a' * 64}_account__session_{SESSION}"


def body(user_id: Any = None) -> dict[str, Any]:
    return {} if user_id is None else {"metadata": {"user_id": user_id}}


@pytest.mark.parametrize(
    ("headers", "payload", "client", "expected"),
    [
        # Each source wins over every later one.
        (
            {"x-agent-id": "planner", "x-claude-code-session-id": "s1"},
            body(USER_ID_JSON),
            "10.0.0.1",
            "planner",
        ),
        ({"x-claude-code-session-id": "s1"}, body(USER_ID_JSON), "10.0.0.1", "s1"),
        ({}, body(USER_ID_JSON), "10.0.0.1", SESSION),
        ({}, body(USER_ID_LEGACY), "10.0.0.1", SESSION),
        ({}, body(), "10.0.0.1", "10.0.0.1"),
        ({}, body(), None, "anonymous"),
        # Empty or blank sources are skipped.
        ({"x-agent-id": "  ", "x-claude-code-session-id": ""}, body(), "10.0.0.1", "10.0.0.1"),
        ({}, body(""), "10.0.0.1", "10.0.0.1"),
        ({}, body(json.dumps({"session_id": ""})), "h", "h"),
        # A user_id that holds no session, or is not a string, or metadata that is not an object.
        ({}, body("just-a-user"), "h", "h"),
        ({}, body(json.dumps({"device_id": "x"})), "h", "h"),
        ({}, body(42), "h", "h"),
        ({}, {"metadata": "user_x_session_abc"}, "h", "h"),
        ({}, body(json.dumps({"session_id": 7})), "h", "h"),
        # Surrounding spaces go.
        ({"x-agent-id": "  coder  "}, body(), "h", "coder"),
    ],
)
def test_sources_and_their_order(
    headers: dict[str, str], payload: dict[str, Any], client: str | None, expected: str
) -> None:
    assert agent_identity(headers, payload, client) == expected


def test_poisoned_user_id_falls_through_or_is_cleaned() -> None:
    """A session_id that decodes to lone surrogates never becomes an agent id as it is."""
    only_surrogate = '{"session_id":"\\udc00"}'
    assert agent_identity({}, body(only_surrogate), "10.0.0.9") == "10.0.0.9"
    mixed = '{"session_id":"ab\\udc00cd\\u0000\\u001b[31m"}'
    agent = agent_identity({}, body(mixed), "10.0.0.9")
    assert agent == "abcd[31m"
    agent.encode("utf-8")  # encodable everywhere: a file name digest, a log line, JSON
    # A user_id that is itself a lone surrogate string, or hostile JSON, is no crash either.
    assert agent_identity({}, body("\udc00"), "h") == "h"
    assert agent_identity({}, body("[" * 5000), "h") == "h"
    assert agent_identity({}, body('{"session_id": NaN}'), "h") == "h"


def test_an_oversized_user_id_is_not_a_source() -> None:
    huge = json.dumps({"session_id": "s" * 10_000})
    assert agent_identity({}, body(huge), "10.0.0.1") == "10.0.0.1"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("frontend", "frontend"),
        ("with space", "with space"),
        ("é-ñ-中文-✓", "é-ñ-中文-✓"),
        ("line\nbreak\r\n", "linebreak"),
        ("\x1b[2Jclear", "[2Jclear"),
        ("bidi\u202eevil", "bidievil"),
        ("zero\u200bwidth", "zerowidth"),
        ("\ud800lone\udfff", "lone"),
        ("\x00\x01\x7f", None),
        ("", None),
        ("   ", None),
    ],
)
def test_cleaning_keeps_printable_text_only(raw: str, expected: str | None) -> None:
    assert clean_agent_id(raw) == expected


def test_long_ids_become_a_stable_digest_form() -> None:
    """Over 128 characters: the first 40, an ellipsis and 12 hex digits of the id's SHA-256."""
    exact = "a" * MAX_AGENT_ID
    assert clean_agent_id(exact) == exact
    long_id = "agent-" + "x" * 200
    short = clean_agent_id(long_id)
    assert short is not None
    digest = hashlib.sha256(long_id.encode()).hexdigest()[:12]
    assert short == long_id[:40] + "…#" + digest
    assert clean_agent_id(long_id) == short
    assert clean_agent_id(long_id + "y") != short
    # A 4 MB id costs a digest, not a 4 MB table row.
    huge = "h" * (4 * 1024 * 1024)
    out = clean_agent_id(huge)
    assert out is not None and len(out) == 54 and out.startswith("h" * 40 + "…#")
    assert clean_agent_id(huge + "\udc00") not in (None, out)
    assert agent_identity({"x-agent-id": huge}, {}, None) == out


@pytest.mark.parametrize(("raw", "expected"), [(None, 1), ("", 1), (" ", 1), ("0", 0), (" 3 ", 3)])
def test_priority_header(raw: str | None, expected: int) -> None:
    headers = {} if raw is None else {"x-agent-priority": raw}
    assert agent_priority(headers) == expected


@pytest.mark.parametrize("raw", ["4", "-1", "high", "1.5", "9" * 5000])
def test_bad_priority_is_a_400_naming_the_header(raw: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        agent_priority({"x-agent-priority": raw})
    message = info.value.message
    assert message.startswith("header x-agent-priority: must be an integer from 0")
    assert len(message) < 200


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("", None),
        ("a0d86d4bb560b1f1f", "a0d86d4bb560b1f1f"),
        ("a/b\nc", "a_bc"),  # never a separator, never a control character
        ("\x1b[2J", "[2J"),
    ],
)
def test_subagent_id_is_cleaned(raw: str | None, expected: str | None) -> None:
    headers = {} if raw is None else {"x-claude-code-agent-id": raw}
    assert subagent_id(headers) == expected


def test_a_long_subagent_id_becomes_a_short_stable_form() -> None:
    first = subagent_id({"x-claude-code-agent-id": "f" * 500})
    again = subagent_id({"x-claude-code-agent-id": "f" * 500})
    other = subagent_id({"x-claude-code-agent-id": "f" * 499 + "e"})
    assert first == again != other
    assert first is not None and len(first) <= MAX_SUBAGENT_ID
