"""What the Responses stream and the Chat Completions chunks share: the error body, ids, and the
walk over a reply's events (:mod:`agentkv.reply`). Pure.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from agentkv.exceptions import AgentKVError, InvalidRequestError, PromptTooLongError
from agentkv.openai_request import CUSTOM_INPUT, OpenAIRequest, ToolOrigin
from agentkv.reply import BlockClosed, BlockOpened, Delta, ReplyEvent, Started, Usage

__all__ = ["EventWalk", "openai_error"]

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


def digest(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def openai_call_id(tool_use_id: str) -> str:
    """An OpenAI call id for a tool_use id (``toolu_x`` -> ``call_x``); Codex echoes it back."""
    return "call_" + tool_use_id.removeprefix("toolu_")


def tool_origin(request: OpenAIRequest, engine_name: str) -> ToolOrigin:
    return request.tools.get(engine_name) or ToolOrigin(engine_name)


def custom_input(arguments: str) -> str:
    """A custom tool's input: the ``input`` string of the engine's call, else the raw JSON."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


@attrs.define
class EventWalk:
    """One reply's events, walked in order: what both OpenAI streams do with them.

    A subclass says what each event becomes (:meth:`_start`, :meth:`_open`, :meth:`_delta`,
    :meth:`_close`, :meth:`_finish`); the walk keeps the stop reason and the usage, and passes
    nothing on before ``Started`` (only the first counts) or after the end.
    """

    _stop_reason: str | None = attrs.field(default=None, init=False)
    _usage: Usage = attrs.field(factory=Usage, init=False)
    _ended: bool = attrs.field(default=False, init=False)
    _started: bool = attrs.field(default=False, init=False)

    def feed(self, events: Iterable[ReplyEvent]) -> list[dict[str, Any]]:
        """What these reply events become, in order."""
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Started):
                if not self._started:
                    self._started = True
                    self._start(event.message_id, out)
            elif not self._started or self._ended:
                continue
            elif isinstance(event, BlockOpened):
                self._open(event, out)
            elif isinstance(event, Delta):
                self._delta(event, out)
            elif isinstance(event, BlockClosed):
                self._close(out)
            else:
                self._stop_reason, self._usage = event.stop_reason, event.usage
                self._finish(out)
        return out

    def _start(self, message_id: str, out: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _open(self, block: BlockOpened, out: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _delta(self, delta: Delta, out: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _close(self, out: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _finish(self, out: list[dict[str, Any]]) -> None:
        raise NotImplementedError
