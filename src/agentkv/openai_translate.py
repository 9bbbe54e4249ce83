"""OpenAITranslator: OpenAI Responses and Chat Completions requests in, Messages bodies out.

agentkv has one request lifecycle, built around the Anthropic Messages API: queue, slot placement,
prefix store, compaction, tool repair and records all work on a Messages body. The OpenAI routes
therefore translate their body into exactly the Messages body that ``/v1/messages`` would take for
the same conversation, and the runtime never knows which API a request came in on. The reply comes
back as typed events (:mod:`agentkv.reply`), which :mod:`agentkv.openai_sse` encodes as the
client's own stream.

Pure: no I/O, no clock. Each input item or message is translated on its own and only ever appended
to, so a conversation that grows by items keeps a prompt that grows by appending too, and the
engine's cache keeps hitting.

Errors are :class:`~agentkv.exceptions.InvalidRequestError` naming the OpenAI field
(``input[3].content[0].type``); the server writes them in the OpenAI error shape.

The Responses half lives in :mod:`agentkv.responses_translate`, the Chat Completions half in
:mod:`agentkv.chat_translate`, and what they share (the request value, the shapes both use, tools,
the conversation) in :mod:`agentkv.openai_request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from agentkv.chat_translate import chat_request
from agentkv.limits import RequestLimits
from agentkv.openai_request import DEFAULT_MAX_TOKENS, OpenAIRequest, ToolOrigin
from agentkv.responses_translate import HOSTED_TOOL_TYPES, responses_request

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "HOSTED_TOOL_TYPES",
    "OpenAIRequest",
    "OpenAITranslator",
    "ToolOrigin",
]


@attrs.frozen
class OpenAITranslator:
    """Validates OpenAI request bodies and turns them into Messages bodies.

    ``limits`` are the runtime's own (see :mod:`agentkv.limits`); the item count is checked here
    before any item is read, the rest once the Messages body is prepared.
    """

    limits: RequestLimits = attrs.field(factory=RequestLimits)

    def responses(self, body: Mapping[str, Any]) -> OpenAIRequest:
        """A ``POST /v1/responses`` body as a Messages body (see ``responses_translate``)."""
        return responses_request(body, self.limits)

    def chat(self, body: Mapping[str, Any]) -> OpenAIRequest:
        """A ``POST /v1/chat/completions`` body as a Messages body (see ``chat_translate``)."""
        return chat_request(body, self.limits)
