"""The Messages API's stream, encoded from a reply's events (``POST /v1/messages``).

:func:`anthropic_events` gives the Anthropic stream events for :mod:`agentkv.reply` events,
:func:`encode_event` frames one, and :func:`accumulate` folds a whole Anthropic stream (checked as
a client would, from agentkv or not) into the non-streaming Message, so both response modes share
one code path. Pure: values in, values out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from agentkv.exceptions import SSEProtocolError
from agentkv.reply import BlockClosed, BlockOpened, Delta, Ended, ReplyEvent, Started, Usage
from agentkv.schema import json_object

__all__ = ["accumulate", "anthropic_events", "anthropic_usage", "encode_event", "reply_message"]


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One SSE frame: ``event: <type>\\ndata: <json>\\n\\n``."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def anthropic_usage(usage: Usage) -> dict[str, int]:
    """Usage in the Messages API's fields (agentkv never writes a cache entry it bills for)."""
    return {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cache_read_tokens,
        "output_tokens": usage.output_tokens,
    }


#: Per delta kind: the Anthropic delta type, and the key that holds its value.
_DELTAS: Final = {
    "text": ("text_delta", "text"),
    "thinking": ("thinking_delta", "thinking"),
    "signature": ("signature_delta", "signature"),
    "input": ("input_json_delta", "partial_json"),
}


def _block(event: BlockOpened) -> dict[str, Any]:
    if event.kind == "text":
        return {"type": "text", "text": ""}
    if event.kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": event.tool_id, "name": event.tool_name, "input": {}}


def anthropic_events(events: Iterable[ReplyEvent]) -> list[dict[str, Any]]:
    """The Messages API's stream events for these reply events, in order (``Ended`` gives
    ``message_delta`` and ``message_stop``)."""
    out: list[dict[str, Any]] = []
    for event in events:
        match event:
            case Started():
                usage = anthropic_usage(Usage(input_tokens=event.input_tokens))
                message: dict[str, Any] = {
                    "id": event.message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": event.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage,
                }
                out.append({"type": "message_start", "message": message})
            case BlockOpened():
                block = _block(event)
                out.append(
                    {"type": "content_block_start", "index": event.index, "content_block": block}
                )
            case Delta():
                kind, key = _DELTAS[event.kind]
                delta = {"type": kind, key: event.value}
                out.append({"type": "content_block_delta", "index": event.index, "delta": delta})
            case BlockClosed():
                out.append({"type": "content_block_stop", "index": event.index})
            case Ended():
                stop = {"stop_reason": event.stop_reason, "stop_sequence": event.stop_sequence}
                usage = anthropic_usage(event.usage)
                out.append({"type": "message_delta", "delta": stop, "usage": usage})
                out.append({"type": "message_stop"})
    return out


def reply_message(events: Iterable[ReplyEvent]) -> dict[str, Any]:
    """The whole reply as one Message (the non-streaming answer)."""
    return accumulate(anthropic_events(events))


_DELTA_FOR = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def accumulate(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold a complete event stream into the Anthropic Message JSON.

    Raises :class:`SSEProtocolError` on events out of order, a delta that does not fit its block,
    tool input that is not a JSON object, an ``error`` event, or a stream without ``message_stop``.
    """
    message: dict[str, Any] | None = None
    open_index: int | None = None
    json_buf = ""
    seen_delta = stopped = False
    for event in events:
        kind = event.get("type")
        if kind == "ping":
            continue
        if kind == "error":
            raise SSEProtocolError(f"stream ended with an error: {event.get('error')}")
        if stopped:
            raise SSEProtocolError(f"{kind} after message_stop")
        if message is None:
            if kind != "message_start":
                raise SSEProtocolError(f"{kind} before message_start")
            message = json.loads(json.dumps(event["message"]))
            message.setdefault("content", [])
            continue
        content: list[dict[str, Any]] = message["content"]
        if kind == "message_start":
            raise SSEProtocolError("message_start twice")
        if kind == "content_block_start":
            if open_index is not None or seen_delta:
                raise SSEProtocolError("content_block_start while a block is open or after the end")
            if event["index"] != len(content):
                raise SSEProtocolError(
                    f"content_block_start index {event['index']} != {len(content)}"
                )
            content.append(dict(event["content_block"]))
            open_index, json_buf = event["index"], ""
        elif kind == "content_block_delta":
            if open_index is None or event["index"] != open_index:
                raise SSEProtocolError(f"content_block_delta for block {event['index']} not open")
            block, delta = content[open_index], event["delta"]
            if delta["type"] == "signature_delta" and block["type"] == "thinking":
                block["signature"] = delta["signature"]
            elif delta["type"] != _DELTA_FOR.get(block["type"]):
                raise SSEProtocolError(f"{delta['type']} in a {block['type']} block")
            elif block["type"] == "tool_use":
                json_buf += delta["partial_json"]
            else:
                block[block["type"]] += delta[block["type"]]  # "text" or "thinking"
        elif kind == "content_block_stop":
            if open_index is None or event["index"] != open_index:
                raise SSEProtocolError(f"content_block_stop for block {event['index']} not open")
            block = content[open_index]
            if block["type"] == "tool_use" and json_buf:
                tool_input = json_object(json_buf)
                if tool_input is None:
                    raise SSEProtocolError(f"tool_use input is not a JSON object: {json_buf!r}")
                block["input"] = tool_input
            open_index = None
        elif kind == "message_delta":
            if open_index is not None or seen_delta:
                raise SSEProtocolError("message_delta while a block is open, or twice")
            seen_delta = True
            message.update(event.get("delta") or {})
            message["usage"].update(event.get("usage") or {})
        elif kind == "message_stop":
            if not seen_delta:
                raise SSEProtocolError("message_stop before message_delta")
            stopped = True
        else:
            raise SSEProtocolError(f"unknown event type {kind!r}")
    if message is None or not stopped:
        raise SSEProtocolError("stream ended before message_stop")
    return message
