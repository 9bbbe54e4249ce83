"""OpenAITranslator: OpenAI Responses and Chat Completions requests in, Messages bodies out.

The runtime works on Messages bodies alone, so each OpenAI body becomes exactly the body that
``/v1/messages`` would take for the same conversation, and the reply's typed events go back out
through :mod:`agentkv.openai_sse`. Errors are :class:`~agentkv.exceptions.InvalidRequestError`
naming the OpenAI field (``input[3].content[0].type``). The halves live in
:mod:`agentkv.responses_translate` and :mod:`agentkv.chat_translate`, what they share in
:mod:`agentkv.openai_request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from agentkv.chat_translate import chat_request
from agentkv.limits import RequestLimits
from agentkv.openai_request import DEFAULT_MAX_TOKENS, OpenAIRequest, ToolOrigin
from agentkv.responses_translate import responses_request

__all__ = [
    "DEFAULT_MAX_TOKENS",
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
