"""Codex-shaped requests, built from a real Codex CLI request (shipped as package data).

The template is the first ``POST /v1/responses`` of a fresh ``codex exec`` session (Codex CLI
0.171.0, a custom provider with ``wire_api = "responses"``) with its identity headers
(``session-id``, ``thread-id``, ``x-codex-turn-metadata``). Another agent's fresh session is that
request with other user words and new ids; the next request of a turn appends the model's
``function_call`` and its ``function_call_output`` to ``input``, as Codex does (``store`` is false
and it sends no ``previous_response_id``). ``scale`` below 1 shortens it as
:func:`agentkv_bench.claude_workload.shrink` shortens Claude Code's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import attrs

from agentkv_bench.claude_workload import _CAPTURED_WORDS, _captured, _cut, _fewer_tools

__all__ = [
    "CodexSession",
    "codex_follow_up",
    "codex_template",
    "fresh_codex_request",
    "shrink_codex",
]

#: Headers of the capture that carry the session (they are given the new session's ids).
_ID_HEADERS = ("session-id", "thread-id", "x-client-request-id")


def codex_template() -> tuple[dict[str, Any], dict[str, str]]:
    """The captured first request of a fresh Codex session and its headers (new copies)."""
    captured = _captured("codex_first_request.json")
    return captured["body"], dict(captured["headers"])


def _shrink_tool(tool: dict[str, Any], scale: float) -> None:
    if isinstance(tool.get("description"), str):
        tool["description"] = _cut(tool["description"], scale)
    for inner in tool.get("tools") or ():
        _shrink_tool(inner, scale)


def shrink_codex(body: dict[str, Any], scale: float) -> dict[str, Any]:
    """``body`` with its developer texts and tool descriptions cut to ``scale`` of their length
    and fewer tools; the order of the items and the user's words are kept."""
    out = copy.deepcopy(body)
    if scale >= 1:
        return out
    for item in out["input"]:
        if item.get("type") == "message" and item.get("role") == "developer":
            for part in item["content"]:
                part["text"] = _cut(part["text"], scale)
    out["tools"] = _fewer_tools(out.get("tools", []), scale)
    for tool in out["tools"]:
        _shrink_tool(tool, scale)
    return out


@attrs.frozen
class CodexSession:
    """The ids of one Codex session: ``codex exec`` gives its thread the session's id."""

    session_id: str
    turn_id: str

    def headers(self, template: dict[str, str], priority: int) -> dict[str, str]:
        """The captured headers with this session's ids, plus ``X-Agent-Priority`` (Codex sends
        it when the provider's ``http_headers`` name it, as docs/openai-agents.md shows)."""
        headers = dict(template)
        for name in _ID_HEADERS:
            headers[name] = self.session_id
        headers["x-codex-window-id"] = f"{self.session_id}:0"
        metadata = json.loads(headers["x-codex-turn-metadata"])
        metadata.update(self._ids(metadata))
        headers["x-codex-turn-metadata"] = json.dumps(metadata, separators=(",", ":"))
        headers["authorization"] = "Bearer bench"
        headers["x-agent-priority"] = str(priority)
        return headers

    def _ids(self, metadata: dict[str, Any]) -> dict[str, Any]:
        ids = {"session_id": self.session_id, "thread_id": self.session_id}
        ids.update(turn_id=self.turn_id, root_turn_id=self.turn_id)
        if "window_id" in metadata:
            ids["window_id"] = f"{self.session_id}:0"
        return ids


def fresh_codex_request(
    template: dict[str, Any], *, words: str, session: CodexSession, max_tokens: int
) -> dict[str, Any]:
    """The first request of a fresh Codex session: ``template`` with these user words and ids,
    its reply bounded (``max_output_tokens``; Codex sets none) and greedy, as
    :func:`agentkv_bench.claude_workload.fresh_request` makes Claude Code's."""
    body = copy.deepcopy(template)
    last = body["input"][-1]
    if last.get("role") != "user" or last["content"][-1].get("text") != _CAPTURED_WORDS:
        raise ValueError("the Codex template's last input item is not the captured user words")
    last["content"][-1]["text"] = words
    body["prompt_cache_key"] = session.session_id
    metadata = body.get("client_metadata")
    if isinstance(metadata, dict):
        inner = json.loads(metadata.get("x-codex-turn-metadata", "{}"))
        inner.update(session._ids(inner))
        metadata.update(session._ids({}))
        metadata["x-codex-turn-metadata"] = json.dumps(inner, separators=(",", ":"))
        if "x-codex-window-id" in metadata:
            metadata["x-codex-window-id"] = f"{session.session_id}:0"
    body.update(max_output_tokens=max_tokens, temperature=0.0, stream=True)
    return body


def codex_follow_up(body: dict[str, Any], turn: int) -> dict[str, Any]:
    """The next request of the turn: the model called ``exec_command``, and here is its output
    (Codex appends the call item and its output item to ``input``)."""
    out = copy.deepcopy(body)
    call_id = f"call_bench{turn:04d}"
    arguments = {"cmd": "ls -la", "workdir": "/home/user/project"}
    out["input"].append(
        {
            "type": "function_call",
            "name": "exec_command",
            "arguments": json.dumps(arguments),
            "call_id": call_id,
        }
    )
    listing = "\n".join(
        f"-rw-r--r-- 1 dev dev {140 + 41 * i:>5} Dec  1 09:{i:02d} module{turn}_{i}.py"
        for i in range(6)
    )
    output = (
        f"Chunk ID: {turn:06x}\nWall time: 0.0102 seconds\nProcess exited with code 0\n"
        f"Output:\n{listing}\n"
    )
    out["input"].append({"type": "function_call_output", "call_id": call_id, "output": output})
    return out
