"""Who is asking and how urgent it is: agent identity and priority from headers and body.

An agent id is client input that ends up in the slot table, in log lines and (hashed) in file
names, so every id is cleaned (:func:`clean_agent_id`) before use; one that is empty once cleaned
does not count, and the next source is asked.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import attrs

from agentkv import InvalidRequestError

__all__ = [
    "CODEX_TURN_METADATA",
    "DEFAULT_PRIORITY",
    "MAX_AGENT_ID",
    "MAX_SUBAGENT_ID",
    "CodexTurn",
    "agent_identity",
    "agent_priority",
    "clean_agent_id",
    "codex_subagent",
    "codex_turn",
    "openai_agent_identity",
    "subagent_id",
]

DEFAULT_PRIORITY = 1
#: Longest agent id kept as it is; a longer one becomes ``<first 40 characters>…#<digest>``.
MAX_AGENT_ID: Final = 128
#: Characters of a long id kept in its digest form, and hex digits of its digest.
_HEAD: Final = 40
_DIGEST: Final = 12
#: Characters of a raw id that are cleaned at most; the digest still covers all of it.
_SCAN: Final = 4096
#: A ``metadata.user_id`` longer than this is not an identity source (Claude Code's is ~150).
_MAX_USER_ID: Final = 8192
_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]+)")
#: Longest sub-agent id kept (Claude Code's are 17 hex characters); a longer one is shortened
#: like a long agent id.
MAX_SUBAGENT_ID: Final = 64


def clean_agent_id(raw: str) -> str | None:
    """``raw`` as printable text of at most :data:`MAX_AGENT_ID` characters, or None if empty.

    Only printable characters stay (no control or format characters such as newlines, ANSI
    escapes or bidi overrides, no surrogates), stripped. A longer result becomes its first 40
    characters, ``…#`` and 12 hex digits of its SHA-256: stable, and long ids stay apart.
    """
    scanned = raw[:_SCAN]
    text = (scanned if scanned.isprintable() else "".join(filter(str.isprintable, scanned))).strip()
    if len(raw) <= _SCAN:
        if not text:
            return None
        if len(text) <= MAX_AGENT_ID:
            return text
        whole = text.encode("utf-8")
    else:
        # Too long to clean in full: the digest is taken over the raw id instead.
        whole = raw.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(whole).hexdigest()[:_DIGEST]
    head = text[:_HEAD].rstrip()
    return f"{head}…#{digest}"


def agent_identity(headers: Mapping[str, str], body: Mapping[str, Any], client: str | None) -> str:
    """The agent a request belongs to, cleaned by :func:`clean_agent_id`.

    In order: ``X-Agent-Id``; ``X-Claude-Code-Session-Id``; the ``session_id`` inside
    ``metadata.user_id`` (Claude Code sends a JSON string there; older versions sent
    ``user_…_session_<uuid>``); the client's address; ``anonymous``. A source that is missing,
    empty, or empty once cleaned is skipped.
    """

    def sources() -> Iterator[str | None]:
        yield headers.get("x-agent-id")
        yield headers.get("x-claude-code-session-id")
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
        if isinstance(user_id, str) and 0 < len(user_id) <= _MAX_USER_ID:
            yield _session_from_user_id(user_id)

    return _first_identity(sources(), client)


def _first_identity(sources: Iterable[str | None], client: str | None) -> str:
    """The first source that is not empty once cleaned, else the client's address, else
    ``anonymous``."""
    for source in sources:
        value = clean_agent_id(source) if source else None
        if value:
            return value
    return (clean_agent_id(client) if client else None) or "anonymous"


def subagent_id(headers: Mapping[str, str]) -> str | None:
    """The sub-agent a request comes from inside its session, or None for the session's own.

    Claude Code sends ``x-claude-code-agent-id`` on every request of a sub-agent (its ``Agent``
    tool), and none on the coordinator's.
    """
    raw = headers.get("x-claude-code-agent-id")
    return _sub_id(raw) if raw else None


def _sub_id(raw: str) -> str | None:
    """A sub-agent id cleaned and shortened like an agent id, at most MAX_SUBAGENT_ID long, without
    ``/`` (which separates it from its root in the agent's name)."""
    value = clean_agent_id(raw.replace("/", "_"))
    if value is None or len(value) <= MAX_SUBAGENT_ID:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST]
    return f"{value[: MAX_SUBAGENT_ID - _DIGEST - 2]}…#{digest}"


def _session_from_user_id(user_id: str) -> str | None:
    try:
        parsed = json.loads(user_id)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, Mapping):
        # The JSON form: its session_id or nothing (the legacy pattern would find "session_id").
        session = parsed.get("session_id")
        return session if isinstance(session, str) else None
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
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise InvalidRequestError(
            f"must be an integer from 0 (most urgent) to 3 (background), got {shown!r}",
            path="header x-agent-priority",
        )
    return value


# -- OpenAI-side clients (Codex, the openai SDK, Chat Completions agents) --------------------------

#: Codex's per-request JSON header: its session, thread and agent (``/root`` for the main agent).
CODEX_TURN_METADATA = "x-codex-turn-metadata"
#: Longest ``x-codex-turn-metadata`` read (Codex's is about 900 characters).
_MAX_TURN_METADATA = 16384


@attrs.frozen
class CodexTurn:
    """What Codex says about a request in ``x-codex-turn-metadata`` (cleaned; None when absent).

    ``thread_id`` names one conversation (a fresh ``codex exec``'s equals ``session_id``); a
    sub-agent Codex spawns has its own thread in the same session, ``parent_thread_id`` naming the
    spawning one and ``subagent_kind`` (``thread_spawn``) how it came to be (Codex 0.171.0).
    """

    session_id: str | None = None
    thread_id: str | None = None
    agent_name: str | None = None
    turn_id: str | None = None
    request_kind: str | None = None
    parent_thread_id: str | None = None
    subagent_kind: str | None = None


def codex_turn(headers: Mapping[str, str]) -> CodexTurn | None:
    """``x-codex-turn-metadata`` parsed, or None when it is missing or not a JSON object."""
    raw = headers.get(CODEX_TURN_METADATA)
    if not raw or len(raw) > _MAX_TURN_METADATA:
        return None
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, Mapping):
        return None
    values = {name: parsed.get(name) for name in attrs.fields_dict(CodexTurn)}
    return CodexTurn(
        **{k: clean_agent_id(v) if isinstance(v, str) else None for k, v in values.items()}
    )


def openai_agent_identity(
    headers: Mapping[str, str], body: Mapping[str, Any], client: str | None
) -> str:
    """The agent an OpenAI-API request (``/v1/responses``, ``/v1/chat/completions``) belongs to.

    In order: ``X-Agent-Id``; Codex's thread (``thread_id`` in ``x-codex-turn-metadata``, then the
    ``thread-id`` header), then its session (``session_id`` there, then ``session-id``); the body's
    ``prompt_cache_key``, then ``user`` (what other clients send to tell conversations or users
    apart); the client's address; ``anonymous``. Every value is cleaned by :func:`clean_agent_id`.
    """

    def sources() -> Iterator[str | None]:
        yield headers.get("x-agent-id")
        turn = codex_turn(headers)
        yield turn.thread_id if turn else None
        yield headers.get("thread-id")
        yield turn.session_id if turn else None
        yield headers.get("session-id")
        for name in ("prompt_cache_key", "user"):
            value = body.get(name)
            yield value if isinstance(value, str) and len(value) <= _MAX_USER_ID else None

    return _first_identity(sources(), client)


def codex_subagent(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """``(root, sub-agent id)`` for a sub-agent that Codex spawned, else None.

    The sub-agent hangs under the agent of the spawning thread (``parent_thread_id``), or under
    ``X-Agent-Id`` when the client names one, with its own thread as its id.
    """
    turn = codex_turn(headers)
    if turn is None or not turn.parent_thread_id or not turn.thread_id:
        return None
    if turn.thread_id == turn.parent_thread_id:
        return None
    sub = _sub_id(turn.thread_id)
    if sub is None:
        return None
    return clean_agent_id(headers.get("x-agent-id", "")) or turn.parent_thread_id, sub
