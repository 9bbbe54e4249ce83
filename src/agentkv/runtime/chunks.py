"""The engine's server-sent streams, decoded: one chunk dict after another, or the error.

A chat completion, a raw ``/completion`` and a prefill all stream ``data: {json}`` lines ending in
``data: [DONE]``. :class:`ChunkStream` reads them (:class:`EventParser`), tells a stream that
stopped early (truncated) from one that finished, and raises what the engine reports as an error,
as an ``error`` field or as a chunk's ``error`` key.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from agentkv.exceptions import EngineError, EngineResponseError
from agentkv.runtime.error_map import HTTPX_ERRORS, parse_json

__all__ = [
    "ChunkStream",
    "EventParser",
    "check_chunk",
    "finish_reason",
    "progress_timings",
    "prompt_done",
]

#: What the client makes of a failed read (``None``: the stream ended before it finished).
EngineErrorFor = Callable[[Exception | None], Awaitable[EngineError]]


def check_chunk(chunk: Any) -> dict[str, Any]:
    """A parsed stream chunk, or the engine error it reports."""
    if not isinstance(chunk, dict):
        raise EngineResponseError(f"llama-server stream sent a non-object chunk: {chunk!r:.200}")
    error = chunk.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else str(error)
        code = error.get("code") if isinstance(error, Mapping) else None
        raise EngineResponseError(
            f"llama-server stream failed: {message}",
            upstream_status=code if isinstance(code, int) else None,
        )
    return chunk


def finish_reason(chunk: Mapping[str, Any]) -> Any:
    if chunk.get("stop") is True:  # llama-server's native /completion stream
        return chunk.get("stop_type") or "stop"
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0].get("finish_reason")
    return None


def prompt_done(chunk: Mapping[str, Any]) -> int | None:
    """How many of the prompt's tokens the engine has (cached or computed), from a chunk's
    ``prompt_progress``; None when the chunk carries none. llama-server's ``processed`` is the
    slot's whole prompt so far, the cached tokens included (``cache`` 121, ``processed`` 130 of
    ``total`` 130 for a prompt that computed 9)."""
    progress = chunk.get("prompt_progress")
    if not isinstance(progress, Mapping):
        return None
    return int(progress.get("processed", 0) or 0)


def progress_timings(progress: Mapping[str, Any]) -> dict[str, Any]:
    """A ``prompt_progress`` as the ``timings`` fields it tells: tokens cached (``cache_n``),
    computed (``prompt_n``) and the milliseconds spent (``prompt_ms``)."""
    cached, processed = (int(progress.get(key, 0) or 0) for key in ("cache", "processed"))
    return {
        "cache_n": cached,
        "prompt_n": max(0, processed - cached),
        "prompt_ms": float(progress.get("time_ms", 0.0) or 0.0),
    }


#: Where a line of an event stream ends: CRLF, CR or LF.
_LINE_END = re.compile(r"\r\n|\r|\n")


class EventParser:
    """``(event, data)`` of each server-sent event in text fed piece by piece (sans I/O).

    The event-stream rules of the HTML standard (lines end in CRLF, CR or LF; a blank line ends
    an event; ``data`` lines join with newlines; one space after the colon is dropped; a line
    starting with a colon is a comment), plus the ``error:`` field that llama-server versions of
    early 2025 send to report a failure mid-stream: it is read as ``event: error`` with that
    line as its data, so that it is not mistaken for a merely truncated stream. The standard
    says to ignore unknown fields, and so does httpx-sse's public ``EventSource`` (its decoders
    are private, and the SDKs' are too): hence this small parser of our own.
    """

    def __init__(self) -> None:
        #: The start of a line not ended yet.
        self._tail = ""
        self._event = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The events that ``text`` completes."""
        text = self._tail + text
        # A CR at the end may be the first half of a CRLF: the line ends, but wait for the LF.
        held = "\r" if text.endswith("\r") else ""
        lines = _LINE_END.split(text[: len(text) - len(held)])
        self._tail = lines.pop() + held
        return self._lines(lines)

    def close(self) -> list[tuple[str, str]]:
        """The body ended: a last line or event without its line end still counts."""
        tail, self._tail = self._tail.rstrip("\r"), ""
        return self._lines([tail, ""] if tail else [""])

    def _lines(self, lines: list[str]) -> list[tuple[str, str]]:
        events = []
        for line in lines:
            if not line:
                if self._event or self._data:
                    events.append((self._event or "message", "\n".join(self._data)))
                self._event, self._data = "", []
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if field in ("event", "error"):
                self._event = value if field == "event" else "error"
            if field in ("data", "error"):
                self._data.append(value)
        return events


class ChunkStream:
    """Async iterator over the chunk dicts of one streamed completion.

    Ends at ``data: [DONE]``. A stream that stops before ``[DONE]`` without having reported a
    finish reason (``finish_reason``, or ``stop: true`` on ``/completion``) is truncated and
    raises :class:`EngineResponseError`; an ``error`` (field or chunk key) raises the engine's.
    ``engine_error`` gives the error for a read that failed (the client's, which knows whether
    the engine is restarting).
    """

    def __init__(self, response: httpx.Response, engine_error: EngineErrorFor) -> None:
        self._engine_error = engine_error
        self._texts = response.aiter_text()
        self._parser = EventParser()
        #: The events of the last read of the body: a burst of the engine's stream often holds
        #: several, handed out without another trip through the event loop.
        self._batch: deque[tuple[str, str]] = deque()
        self._ended = False
        self._done = False
        self._finished = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def _next_event(self) -> tuple[str, str] | None:
        """The next ``(event, data)``; None once the body has ended."""
        batch = self._batch
        while not batch:
            if self._ended:
                return None
            try:
                text = await self._texts.__anext__()
            except StopAsyncIteration:
                self._ended = True
                # A last event without its closing blank line still counts.
                batch.extend(self._parser.close())
                continue
            except HTTPX_ERRORS as exc:
                self._done = True
                raise await self._engine_error(exc) from exc
            batch.extend(self._parser.feed(text))
        return batch.popleft()

    async def __anext__(self) -> dict[str, Any]:
        while not self._done:
            item = await self._next_event()
            if item is None:
                self._done = True
                if self._finished:
                    break
                raise await self._engine_error(None)
            event, data = item
            if not data and event != "error":
                continue
            if event == "error":
                self._done = True
                check_chunk({"error": parse_json(data, "stream")})
            if data == "[DONE]":
                self._done = True
                break
            try:
                chunk = check_chunk(parse_json(data, "stream"))
            except EngineError:
                self._done = True
                raise
            if finish_reason(chunk) is not None:
                self._finished = True
            return chunk
        await self._texts.aclose()  # type: ignore[attr-defined]
        raise StopAsyncIteration
