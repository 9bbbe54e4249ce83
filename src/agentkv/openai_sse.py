"""A reply's events in, OpenAI streams out: where the server finds the Responses event stream
(:mod:`agentkv.responses_sse`), the Chat Completions chunks (:mod:`agentkv.chat_sse`) and what
they share (:mod:`agentkv.openai_reply`), and their SSE framing. Fed the whole event list at
once, each assembler gives the non-streaming reply too, so both modes share one code path, as on
the Anthropic side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from agentkv.chat_sse import ChatAssembler
from agentkv.openai_reply import openai_error
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

#: The line that ends a Chat Completions stream.
CHAT_DONE: Final = b"data: [DONE]\n\n"
#: A comment line: OpenAI clients skip it, and it keeps the connection from looking idle.
CHAT_KEEPALIVE: Final = b": keep-alive\n\n"

# Characters that JSON leaves as they are but that line splitters modelled on str.splitlines()
# (httpx's iter_lines among them) take for line ends, which would cut an SSE data line in two.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).translate(_LINE_ENDS)


def encode_response_event(event: Mapping[str, Any]) -> bytes:
    """One Responses SSE frame: ``event: <type>\\ndata: <json>\\n\\n``."""
    return f"event: {event['type']}\ndata: {_json(event)}\n\n".encode()


def encode_chat_chunk(chunk: Mapping[str, Any]) -> bytes:
    """One Chat Completions SSE frame: ``data: <json>\\n\\n``."""
    return f"data: {_json(chunk)}\n\n".encode()
