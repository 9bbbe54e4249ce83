"""A reply's events in, OpenAI streams out: the Responses event stream and Chat chunks.

The runtime answers every request with the reply's typed events (:mod:`agentkv.reply`), whichever
route it came in on. :class:`ResponsesAssembler` and :class:`ChatAssembler` turn those events into
what an OpenAI client reads: ``response.*`` events for ``/v1/responses`` (what Codex and the
``openai`` SDK expect) and ``chat.completion.chunk`` objects for ``/v1/chat/completions``. Fed the
whole event list at once, they give the non-streaming reply too
(:attr:`ResponsesAssembler.response`, :attr:`ChatAssembler.completion`), so both modes share one
code path, as on the Anthropic side.

Pure: events (already in order, as :class:`~agentkv.sse.SSEAssembler` promises) and the creation
time go in, dicts come out; :func:`encode_response_event` and :func:`encode_chat_chunk` frame them.
A tool call arrives from the runtime whole (its input is known to be a JSON object), so its
arguments go out as one delta.

The Responses half lives in :mod:`agentkv.responses_sse`, the Chat Completions half in
:mod:`agentkv.chat_sse`, and what they share (the error body, the framing, the walk over the
events) in :mod:`agentkv.openai_reply`; this module is where the server finds them.
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
