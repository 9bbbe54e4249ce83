"""A reply's events in, OpenAI streams out: where the server finds the Responses event stream
(:mod:`agentkv.responses_sse`), the Chat Completions chunks (:mod:`agentkv.chat_sse`) and what
they share (:mod:`agentkv.openai_reply`). Fed the whole event list at once, each assembler gives
the non-streaming reply too, so both modes share one code path, as on the Anthropic side.
"""

from __future__ import annotations

from agentkv.chat_sse import ChatAssembler
from agentkv.openai_reply import (
    CHAT_DONE,
    CHAT_KEEPALIVE,
    encode_chat_chunk,
    encode_response_event,
    openai_error,
)
from agentkv.responses_sse import ResponsesAssembler

__all__ = [
    "CHAT_DONE",
    "CHAT_KEEPALIVE",
    "ChatAssembler",
    "ResponsesAssembler",
    "encode_chat_chunk",
    "encode_response_event",
    "openai_error",
]
