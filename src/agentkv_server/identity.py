"""Who is asking and how urgent it is: agent identity and priority from headers and body."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agentkv import InvalidRequestError

__all__ = ["DEFAULT_PRIORITY", "agent_identity", "agent_priority"]

DEFAULT_PRIORITY = 1
_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]+)")


def agent_identity(headers: Mapping[str, str], body: Mapping[str, Any], client: str | None) -> str:
    """The agent a request belongs to.

    In order: ``X-Agent-Id``; ``X-Claude-Code-Session-Id``; the ``session_id`` inside
    ``metadata.user_id`` (Claude Code sends a JSON string there; older versions sent
    ``user_…_session_<uuid>``); the client's address.
    """
    for name in ("x-agent-id", "x-claude-code-session-id"):
        value = headers.get(name, "").strip()
        if value:
            return value
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user_id, str) and user_id:
        session = _session_from_user_id(user_id)
        if session:
            return session
    return client or "anonymous"


def _session_from_user_id(user_id: str) -> str | None:
    try:
        parsed = json.loads(user_id)
    except ValueError:
        parsed = None
    if isinstance(parsed, Mapping):
        session = parsed.get("session_id")
        if isinstance(session, str) and session:
            return session
    found = _SESSION_IN_USER_ID.search(user_id)
    return found.group(1) if found else None


def agent_priority(headers: Mapping[str, str], default: int = DEFAULT_PRIORITY) -> int:
    """``X-Agent-Priority``: 0 (most urgent) … 3 (background). Anything else is a 400."""
    raw = headers.get("x-agent-priority")
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if not 0 <= value <= 3:
        raise InvalidRequestError(
            f"must be an integer from 0 (most urgent) to 3 (background), got {raw!r}",
            path="header x-agent-priority",
        )
    return value
