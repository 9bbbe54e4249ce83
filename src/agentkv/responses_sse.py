"""A reply's events in, the Responses event stream out (``POST /v1/responses``).

A tool call arrives from the runtime whole (its input is known to be a JSON object), so its
arguments go out as one delta. Pure: events and the creation time go in, dicts come out.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs

from agentkv.exceptions import AgentKVError, SSEProtocolError
from agentkv.openai_reply import (
    EventWalk,
    custom_input,
    digest,
    openai_call_id,
    openai_error,
    tool_origin,
)
from agentkv.openai_request import OpenAIRequest
from agentkv.reply import BlockOpened, Delta

__all__ = ["ResponsesAssembler"]

#: Per output item kind: the kind of delta that adds to it.
_DELTAS: Final = {"text": "text", "thinking": "thinking", "function": "input", "custom": "input"}
#: The Responses events (``<name>.delta``, ``<name>.done``) of a text or reasoning part.
_TEXT_EVENTS: Final = {"text": "response.output_text", "thinking": "response.reasoning_text"}
#: Per tool call kind: its item id's prefix, its item type, and the field its input goes in.
_CALLS: Final = {
    "function": ("fc", "function_call", "arguments"),
    "custom": ("ctc", "custom_tool_call", "input"),
}


def _logprobs(kind: str) -> dict[str, Any]:
    """Output text events carry ``logprobs`` (always empty here); reasoning events do not."""
    return {"logprobs": []} if kind == "text" else {}


@attrs.define
class _Item:
    """The output item being streamed: a message, a reasoning item or a tool call."""

    index: int
    item: dict[str, Any]
    kind: str  # "text", "thinking", "function", "custom"
    text: str = ""


@attrs.define
class ResponsesAssembler(EventWalk):
    """Turns one reply's events into one Responses event stream.

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

    @property
    def response(self) -> dict[str, Any]:
        """The Response object (in progress until the stream ended)."""
        if self._response is None:
            raise SSEProtocolError("no response yet: the stream has not started")
        return self._response

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
            self._started = True
            self._start("", out)
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

    def _start(self, message_id: str, out: list[dict[str, Any]]) -> None:
        source = message_id or digest(self.created_at)
        self._response = {
            "id": "resp_" + source.removeprefix("msg_"),
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            **self.request.echo,
            "output": [],
        }
        out.append(self._event("response.created", response=self._snapshot()))
        out.append(self._event("response.in_progress", response=self._snapshot()))

    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{digest(self.response['id'], index)}"

    def _open(self, block: BlockOpened, out: list[dict[str, Any]]) -> None:
        self._close(out)  # a well-formed stream has none open; never leave one dangling
        index = len(self.response["output"])
        kind: str = block.kind
        item: dict[str, Any]
        if kind == "text":
            item = {
                "id": self._item_id("msg", index),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        elif kind == "thinking":
            item = {
                "id": self._item_id("rs", index),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "encrypted_content": None,
                "status": "in_progress",
            }
        else:
            origin = tool_origin(self.request, block.tool_name)
            kind = "custom" if origin.custom else "function"
            prefix, item_type, field = _CALLS[kind]
            item = {
                "id": self._item_id(prefix, index),
                "type": item_type,
                "status": "in_progress",
                "call_id": openai_call_id(block.tool_id or self._item_id("toolu", index)),
                "name": origin.name,
                field: "",
            }
            if origin.namespace is not None:
                item["namespace"] = origin.namespace
        current = _Item(index, item, kind)
        self.response["output"].append(item)
        self._current = current
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if current.kind in _TEXT_EVENTS:
            part = self._part(current.kind, "")
            out.append(self._item_event("response.content_part.added", current, part=part))

    def _item_event(self, kind: str, current: _Item, **fields: Any) -> dict[str, Any]:
        """An event about ``current``'s item (and its one content part, for text and reasoning)."""
        if current.kind in _TEXT_EVENTS:
            fields = {"content_index": 0, **fields}
        return self._event(kind, item_id=current.item["id"], output_index=current.index, **fields)

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "text":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def _delta(self, delta: Delta, out: list[dict[str, Any]]) -> None:
        current = self._current
        if current is None or delta.kind != _DELTAS[current.kind]:
            return
        text = delta.value
        current.text += text
        if current.kind in _TEXT_EVENTS:
            name = f"{_TEXT_EVENTS[current.kind]}.delta"
            out.append(self._item_event(name, current, delta=text, **_logprobs(current.kind)))
        elif current.kind == "function":
            name = "response.function_call_arguments.delta"
            out.append(self._item_event(name, current, delta=text))

    def _close(self, out: list[dict[str, Any]]) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        item = current.item
        if current.kind in _TEXT_EVENTS:
            name = f"{_TEXT_EVENTS[current.kind]}.done"
            logprobs = _logprobs(current.kind)
            out.append(self._item_event(name, current, text=current.text, **logprobs))
            part = self._part(current.kind, current.text)
            out.append(self._item_event("response.content_part.done", current, part=dict(part)))
            item["content"] = [part]
        elif current.kind == "function":
            item["arguments"] = current.text or "{}"
            name = "response.function_call_arguments.done"
            out.append(
                self._item_event(name, current, name=item["name"], arguments=item["arguments"])
            )
        else:
            item["input"] = custom_input(current.text)
            for step, field in (("delta", "delta"), ("done", "input")):
                name = f"response.custom_tool_call_input.{step}"
                out.append(self._item_event(name, current, **{field: item["input"]}))
        item["status"] = "completed"
        out.append(
            self._event("response.output_item.done", output_index=current.index, item=dict(item))
        )

    def _finish(self, out: list[dict[str, Any]]) -> None:
        self._close(out)
        response = self.response
        usage = self._usage
        response["usage"] = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cache_read_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.output_tokens,
        }
        self._ended = True
        cut = self._stop_reason == "max_tokens"
        response["status"] = "incomplete" if cut else "completed"
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        out.append(self._event(f"response.{response['status']}", response=self._snapshot()))
