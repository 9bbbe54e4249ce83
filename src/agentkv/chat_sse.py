"""A reply's events in, Chat Completions chunks out (``POST /v1/chat/completions``). Pure: events
and the creation time go in, dicts come out.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from agentkv.exceptions import AgentKVError
from agentkv.openai_reply import (
    EventWalk,
    digest,
    openai_call_id,
    openai_error,
    tool_origin,
)
from agentkv.openai_request import OpenAIRequest
from agentkv.reply import BlockOpened, Delta

__all__ = ["ChatAssembler"]

_STOP_TO_FINISH: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


@attrs.define
class ChatAssembler(EventWalk):
    """Turns one reply's events into Chat Completions chunks.

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
        usage = self._usage
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.prompt_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens},
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
            message["tool_calls"] = [{**c, "function": {**c["function"]}} for c in self._calls]
            for call in message["tool_calls"]:
                call["function"]["arguments"] = call["function"]["arguments"] or "{}"
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

    # -- the walk --------------------------------------------------------------------------------

    def _start(self, message_id: str, out: list[dict[str, Any]]) -> None:
        source = message_id or digest(self.created)
        self._id = "chatcmpl-" + source.removeprefix("msg_")
        out.append(self._chunk({"role": "assistant", "content": ""}))

    def _close(self, out: list[dict[str, Any]]) -> None:
        self._block = None

    def _finish(self, out: list[dict[str, Any]]) -> None:
        self._ended = True
        out.append(self._chunk({}, finish_reason=self.finish_reason))
        if self.request.include_usage:
            out.append({**self._header([]), "usage": self.usage})

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk = self._header(
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _header(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }

    def _open(self, block: BlockOpened, out: list[dict[str, Any]]) -> None:
        self._block = block.kind
        if block.kind != "tool_use":
            return
        origin = tool_origin(self.request, block.tool_name)
        index = len(self._calls)
        call: dict[str, Any] = {
            "id": openai_call_id(block.tool_id or f"toolu_{digest(self._id, index)}"),
            "type": "function",
            "function": {"name": origin.name, "arguments": ""},
        }
        self._calls.append(call)
        # The chunk gets copies: the call's arguments grow as deltas come.
        out.append(
            self._chunk(
                {"tool_calls": [{"index": index, **call, "function": {**call["function"]}}]}
            )
        )

    def _delta(self, delta: Delta, out: list[dict[str, Any]]) -> None:
        kind, text = delta.kind, delta.value
        if kind == "text" and self._block == "text":
            self._text += text
            out.append(self._chunk({"content": text}))
        elif kind == "thinking" and self._block == "thinking":
            self._reasoning += text
            out.append(self._chunk({"reasoning_content": text}))
        elif kind == "input" and self._block == "tool_use" and self._calls:
            self._calls[-1]["function"]["arguments"] += text
            index = len(self._calls) - 1
            out.append(
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            )
