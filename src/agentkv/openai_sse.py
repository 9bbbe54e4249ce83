"""Anthropic stream events in, OpenAI streams out: the Responses event stream and Chat chunks.

The runtime answers every request with Anthropic Messages events (:mod:`agentkv.sse`), whichever
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
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from agentkv.exceptions import (
    AgentKVError,
    InvalidRequestError,
    PromptTooLongError,
    SSEProtocolError,
)
from agentkv.openai_translate import CUSTOM_INPUT, OpenAIRequest, ToolOrigin

__all__ = [
    "CHAT_DONE",
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

# error.type of an AgentKVError -> (OpenAI error type, code). Codex reads the code:
# context_length_exceeded means "compact", server_is_overloaded means "retry later".
_ERRORS: Final[Mapping[str, tuple[str, str | None]]] = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "permission_error": ("invalid_request_error", "permission_denied"),
    "not_found_error": ("invalid_request_error", "not_found"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded_error": ("server_error", "server_is_overloaded"),
    "api_error": ("server_error", None),
}

_STOP_TO_FINISH: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


def openai_error(exc: AgentKVError, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``.

    ``param`` defaults to the field an :class:`InvalidRequestError` names. A prompt that does not
    fit gets the code ``context_length_exceeded``; an error with ``retry_after`` says when to try
    again in words ("Please try again in 5s."), which Codex reads as the retry delay.
    """
    kind, code = _ERRORS.get(exc.error_type, ("server_error", None))
    if isinstance(exc, PromptTooLongError):
        code = "context_length_exceeded"
    message = exc.message
    if param is None and isinstance(exc, InvalidRequestError):
        param = exc.path
    if exc.retry_after is not None:
        message += f" Please try again in {max(1, math.ceil(exc.retry_after))}s."
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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


def _digest(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def _call_id(tool_use_id: str) -> str:
    """An OpenAI call id for a tool_use id (``toolu_x`` -> ``call_x``); Codex echoes it back."""
    return "call_" + tool_use_id.removeprefix("toolu_")


def _usage(usage: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, of which cached, output tokens) from Anthropic usage."""
    cached = int(usage.get("cache_read_input_tokens") or 0)
    uncached = int(usage.get("input_tokens") or 0) + int(
        usage.get("cache_creation_input_tokens") or 0
    )
    return uncached + cached, cached, int(usage.get("output_tokens") or 0)


def _origin(request: OpenAIRequest, engine_name: str) -> ToolOrigin:
    return request.tools.get(engine_name) or ToolOrigin(engine_name)


def _custom_input(arguments: str) -> str:
    """A custom tool's input: the ``input`` string of the engine's call, else the raw JSON."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


@attrs.define
class _Item:
    """The output item being streamed: a message, a reasoning item or a tool call."""

    index: int
    item: dict[str, Any]
    kind: str  # "text", "thinking", "function", "custom"
    text: str = ""


@attrs.define
class ResponsesAssembler:
    """Turns one Anthropic event stream into one Responses event stream.

    Promises: ``response.created`` and ``response.in_progress`` first; every output item is
    ``added`` before its deltas and ``done`` after them, with ``output_index`` counting up from 0;
    ``sequence_number`` counts every event from 0; the stream ends with exactly one of
    ``response.completed``, ``response.incomplete`` (the reply hit its token limit) or
    ``response.failed`` (after an ``error`` event). :attr:`response` is the Response object so far.
    """

    request: OpenAIRequest
    #: Unix seconds (the route passes the clock's value; nothing here reads a clock).
    created_at: int

    _response: dict[str, Any] | None = attrs.field(default=None, init=False)
    _seq: int = attrs.field(default=0, init=False)
    _current: _Item | None = attrs.field(default=None, init=False)
    _stop_reason: str | None = attrs.field(default=None, init=False)
    _usage: dict[str, Any] = attrs.field(factory=dict, init=False)
    _ended: bool = attrs.field(default=False, init=False)

    @property
    def response(self) -> dict[str, Any]:
        """The Response object (in progress until the stream ended)."""
        if self._response is None:
            raise SSEProtocolError("no response yet: the stream has not started")
        return self._response

    @property
    def ended(self) -> bool:
        return self._ended

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The Responses events for these Anthropic events, in order."""
        out: list[dict[str, Any]] = []
        for event in events:
            kind = event.get("type")
            if kind == "message_start":
                self._start(event.get("message") or {}, out)
            elif self._response is None or self._ended:
                continue
            elif kind == "content_block_start":
                self._open(event.get("content_block") or {}, out)
            elif kind == "content_block_delta":
                self._delta(event.get("delta") or {}, out)
            elif kind == "content_block_stop":
                self._close(out)
            elif kind == "message_delta":
                delta = event.get("delta") or {}
                self._stop_reason = delta.get("stop_reason")
                self._usage.update(event.get("usage") or {})
            elif kind == "message_stop":
                self._finish(out)
        return out

    def keep_alive(self) -> list[dict[str, Any]]:
        """A ``response.in_progress`` event: Codex counts only events (not comments) against its
        idle timeout, and this one every client already knows."""
        if self._response is None or self._ended:
            return []
        return [self._event("response.in_progress", response=self._snapshot())]

    def fail(self, exc: AgentKVError) -> list[dict[str, Any]]:
        """``error`` then ``response.failed``: the request ended with ``exc``."""
        if self._ended:
            return []
        out: list[dict[str, Any]] = []
        if self._response is None:
            self._start({}, out)
        error = openai_error(exc)["error"]
        self._ended = True
        out.append(
            self._event("error", code=error["code"], message=error["message"], param=error["param"])
        )
        response = self.response
        response["status"] = "failed"
        response["error"] = {"code": error["code"] or error["type"], "message": error["message"]}
        out.append(self._event("response.failed", response=self._snapshot()))
        return out

    # -- parts -------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.response))  # type: ignore[no-any-return]

    def _start(self, message: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        if self._response is not None:
            return
        source = str(message.get("id") or _digest(self.created_at))
        echo = self.request.echo
        self._response = {
            "id": "resp_" + source.removeprefix("msg_"),
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "model": self.request.model,
            "output": [],
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "prompt_cache_key": echo.get("prompt_cache_key"),
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "store": False,
            "temperature": echo.get("temperature", 1.0),
            "text": echo.get("text", {"format": {"type": "text"}}),
            "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools", []),
            "top_p": echo.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "user": echo.get("user"),
            "metadata": echo.get("metadata", {}),
        }
        out.append(self._event("response.created", response=self._snapshot()))
        out.append(self._event("response.in_progress", response=self._snapshot()))

    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{_digest(self.response['id'], index)}"

    def _open(self, block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        self._close(out)  # a well-formed stream has none open; never leave one dangling
        index = len(self.response["output"])
        kind = block.get("type")
        item: dict[str, Any]
        if kind == "text":
            item = {
                "id": self._item_id("msg", index),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            current = _Item(index, item, "text")
        elif kind == "thinking":
            item = {
                "id": self._item_id("rs", index),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "encrypted_content": None,
                "status": "in_progress",
            }
            current = _Item(index, item, "thinking")
        elif kind == "tool_use":
            origin = _origin(self.request, str(block.get("name") or ""))
            call_id = _call_id(str(block.get("id") or self._item_id("toolu", index)))
            if origin.custom:
                item = {
                    "id": self._item_id("ctc", index),
                    "type": "custom_tool_call",
                    "status": "in_progress",
                    "call_id": call_id,
                    "name": origin.name,
                    "input": "",
                }
                current = _Item(index, item, "custom")
            else:
                item = {
                    "id": self._item_id("fc", index),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": call_id,
                    "name": origin.name,
                    "arguments": "",
                }
                current = _Item(index, item, "function")
            if origin.namespace is not None:
                item["namespace"] = origin.namespace
        else:
            return  # no other block kind reaches a client (redacted thinking is never produced)
        self.response["output"].append(item)
        self._current = current
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if current.kind in ("text", "thinking"):
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=self._part(current.kind, ""),
                )
            )

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "text":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def _delta(self, delta: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        current = self._current
        if current is None:
            return
        item_id = current.item["id"]
        kind = delta.get("type")
        if kind == "text_delta" and current.kind == "text":
            text = str(delta.get("text") or "")
            current.text += text
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=current.index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        elif kind == "thinking_delta" and current.kind == "thinking":
            text = str(delta.get("thinking") or "")
            current.text += text
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item_id,
                    output_index=current.index,
                    content_index=0,
                    delta=text,
                )
            )
        elif kind == "input_json_delta" and current.kind in ("function", "custom"):
            text = str(delta.get("partial_json") or "")
            current.text += text
            if current.kind == "function":
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=current.index,
                        delta=text,
                    )
                )

    def _close(self, out: list[dict[str, Any]]) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        item, index = current.item, current.index
        item_id = item["id"]
        if current.kind in ("text", "thinking"):
            done = "response.output_text.done" if current.kind == "text" else None
            if done is not None:
                out.append(
                    self._event(
                        done,
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        text=current.text,
                        logprobs=[],
                    )
                )
            else:
                out.append(
                    self._event(
                        "response.reasoning_text.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        text=current.text,
                    )
                )
            part = self._part(current.kind, current.text)
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
            item["content"] = [part]
        elif current.kind == "function":
            arguments = current.text or "{}"
            item["arguments"] = arguments
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=item["name"],
                    arguments=arguments,
                )
            )
        else:
            text = _custom_input(current.text)
            item["input"] = text
            out.append(
                self._event(
                    "response.custom_tool_call_input.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=text,
                )
            )
            out.append(
                self._event(
                    "response.custom_tool_call_input.done",
                    item_id=item_id,
                    output_index=index,
                    input=text,
                )
            )
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))

    def _finish(self, out: list[dict[str, Any]]) -> None:
        self._close(out)
        response = self.response
        prompt, cached, output = _usage(self._usage)
        response["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        }
        self._ended = True
        if self._stop_reason == "max_tokens":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            out.append(self._event("response.incomplete", response=self._snapshot()))
        else:
            response["status"] = "completed"
            out.append(self._event("response.completed", response=self._snapshot()))


@attrs.define
class ChatAssembler:
    """Turns one Anthropic event stream into Chat Completions chunks.

    Promises: the first chunk carries ``role``; each tool call's first chunk carries its ``index``,
    ``id``, ``type`` and name, later ones only arguments; the last choice chunk carries the
    ``finish_reason``; with ``include_usage`` every chunk has ``usage: null`` and one more chunk,
    with no choices, carries the usage. :attr:`completion` is the non-streaming reply.
    """

    request: OpenAIRequest
    created: int

    _id: str = attrs.field(default="", init=False)
    _text: str = attrs.field(default="", init=False)
    _reasoning: str = attrs.field(default="", init=False)
    _calls: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    _block: str | None = attrs.field(default=None, init=False)
    _stop_reason: str | None = attrs.field(default=None, init=False)
    _usage: dict[str, Any] = attrs.field(factory=dict, init=False)
    _started: bool = attrs.field(default=False, init=False)
    _ended: bool = attrs.field(default=False, init=False)

    @property
    def ended(self) -> bool:
        return self._ended

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The chunks for these Anthropic events, in order."""
        out: list[dict[str, Any]] = []
        for event in events:
            kind = event.get("type")
            if kind == "message_start":
                if not self._started:
                    self._started = True
                    message = event.get("message") or {}
                    source = str(message.get("id") or _digest(self.created))
                    self._id = "chatcmpl-" + source.removeprefix("msg_")
                    out.append(self._chunk({"role": "assistant", "content": ""}))
            elif not self._started or self._ended:
                continue
            elif kind == "content_block_start":
                self._open(event.get("content_block") or {}, out)
            elif kind == "content_block_delta":
                self._delta(event.get("delta") or {}, out)
            elif kind == "content_block_stop":
                self._block = None
            elif kind == "message_delta":
                self._stop_reason = (event.get("delta") or {}).get("stop_reason")
                self._usage.update(event.get("usage") or {})
            elif kind == "message_stop":
                self._ended = True
                out.append(self._chunk({}, finish_reason=self.finish_reason))
                if self.request.include_usage:
                    out.append(self._usage_chunk())
        return out

    def fail(self, exc: AgentKVError) -> list[dict[str, Any]]:
        """The error as a chunk of its own (the ``openai`` SDK raises it)."""
        if self._ended:
            return []
        self._ended = True
        return [openai_error(exc)]

    @property
    def finish_reason(self) -> str:
        return _STOP_TO_FINISH.get(self._stop_reason or "", "stop")

    @property
    def usage(self) -> dict[str, Any]:
        prompt, cached, output = _usage(self._usage)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @property
    def completion(self) -> dict[str, Any]:
        """The ``chat.completion`` object for everything fed so far."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self._text if self._text or not self._calls else None,
            "refusal": None,
        }
        if self._reasoning:
            message["reasoning_content"] = self._reasoning
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"] or "{}"},
                }
                for call in self._calls
            ]
        return {
            "id": self._id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.request.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage,
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": [],
            "usage": self.usage,
        }

    def _open(self, block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        kind = block.get("type")
        self._block = kind if isinstance(kind, str) else None
        if kind != "tool_use":
            return
        origin = _origin(self.request, str(block.get("name") or ""))
        index = len(self._calls)
        call = {
            "id": _call_id(str(block.get("id") or f"toolu_{_digest(self._id, index)}")),
            "name": origin.name,
            "arguments": "",
        }
        self._calls.append(call)
        out.append(
            self._chunk(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )

    def _delta(self, delta: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        kind = delta.get("type")
        if kind == "text_delta" and self._block == "text":
            text = str(delta.get("text") or "")
            self._text += text
            out.append(self._chunk({"content": text}))
        elif kind == "thinking_delta" and self._block == "thinking":
            text = str(delta.get("thinking") or "")
            self._reasoning += text
            out.append(self._chunk({"reasoning_content": text}))
        elif kind == "input_json_delta" and self._block == "tool_use" and self._calls:
            text = str(delta.get("partial_json") or "")
            call = self._calls[-1]
            call["arguments"] += text
            index = len(self._calls) - 1
            out.append(
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            )
