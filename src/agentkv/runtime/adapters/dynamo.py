"""NVIDIA Dynamo behind agentkv: its agent hints, its session headers, the cache hit.

What Dynamo documents and agentkv uses (Dynamo's "Agent Hints", "Session IDs" and "Priority
Scheduling" guides; its frontend's ``lib/llm/src/protocols/agents.rs``):

- ``nvext.agent_hints.priority`` in the chat body: "higher values mean higher priority at the
  Dynamo API layer"; Dynamo orders its router queue by it and forwards it, normalised, to a
  backend started with priority scheduling (vLLM ``--scheduling-policy priority``, SGLang
  ``--enable-priority-scheduling``). agentkv's 0 (most urgent) … 3 (background) is sent as 3 … 0.
- ``x-dynamo-session-id``, one value per agent, and ``x-dynamo-parent-session-id`` for a
  sub-agent: Dynamo's canonical session headers, which take precedence over the agent-native
  ones it also maps (``x-claude-code-session-id``, ``x-claude-code-agent-id``, Codex's
  ``thread-id``…). They are passive identity for Dynamo's traces unless its router is configured
  for session affinity, which then keeps a session on one worker.
- ``usage.prompt_tokens_details.cached_tokens``, which Dynamo's frontend fills from its backend's
  report.
"""

from __future__ import annotations

from typing import Any, ClassVar

from agentkv.runtime.adapters.base import OpenAIEngineClient, header_value
from agentkv.runtime.hints import EngineHints

__all__ = ["PARENT_HEADER", "SESSION_HEADER", "DynamoClient"]

SESSION_HEADER = "x-dynamo-session-id"
PARENT_HEADER = "x-dynamo-parent-session-id"


class DynamoClient(OpenAIEngineClient):
    """The OpenAI-compatible frontend of NVIDIA Dynamo (``python -m dynamo.frontend``)."""

    kind: ClassVar[str] = "dynamo"
    engine_name: ClassVar[str] = "Dynamo"

    def hint_fields(self, hints: EngineHints) -> dict[str, Any]:
        return {"nvext": {"agent_hints": {"priority": hints.urgency}}}

    def hint_headers(self, hints: EngineHints) -> dict[str, str]:
        headers = {SESSION_HEADER: header_value(hints.agent)}
        if hints.parent is not None:
            headers[PARENT_HEADER] = header_value(hints.parent)
        return headers
