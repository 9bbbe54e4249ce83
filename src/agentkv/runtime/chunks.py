"""The engine's server-sent streams, decoded: one chunk dict after another, or the error.

A chat completion, a raw ``/completion`` and a prefill all stream ``data: {json}`` lines ending in
``data: [DONE]``. :class:`ChunkStream` reads them with httpx-sse's decoders, tells a stream that
stopped early (truncated) from one that finished, and raises what the engine reports as an error,
as an ``error`` field or as a chunk's ``error`` key.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

# httpx-sse's decoders: its EventSource would drop the `error:` field older llama-servers use.
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from agentkv.exceptions import EngineError, EngineResponseError
from agentkv.runtime.error_map import HTTPX_ERRORS, parse_json

__all__ = ["ChunkStream", "check_chunk", "finish_reason", "prompt_done"]

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
    ``prompt_progress``; None when the chunk carries none."""
    progress = chunk.get("prompt_progress")
    if not isinstance(progress, Mapping):
        return None
    return int(progress.get("cache", 0) or 0) + int(progress.get("processed", 0) or 0)


class _Decoder(SSEDecoder):
    """httpx-sse's event decoder, plus the ``error:`` field older llama-servers send.

    The SSE spec ignores unknown fields; llama-server versions of early 2025 report a failure
    mid-stream as ``error: {json}``, which must not be mistaken for a merely truncated stream.
    """

    def decode(self, line: str) -> Any:
        if line.startswith("error:"):
            super().decode("event: error")
            line = "data:" + line[len("error:") :]
        return super().decode(line)


class _Events:
    """``(event, data)`` of each server-sent event of a response, a read's worth at a time.

    Each read of the body gives a batch of events (a burst of the engine's stream often holds
    several); the events of a batch are handed out without another trip through the event loop.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._texts = response.aiter_text()
        self._lines = SSELineDecoder()
        self._decoder = _Decoder()
        self._batch: deque[tuple[str, str]] = deque()
        self._ended = False

    def _decoded(self, lines: list[str]) -> None:
        decode, batch = self._decoder.decode, self._batch
        for line in lines:
            event = decode(line)
            if event is not None:
                batch.append((event.event, event.data))

    async def next(self) -> tuple[str, str] | None:
        """The next event; None once the body has ended."""
        batch = self._batch
        while not batch:
            if self._ended:
                return None
            try:
                text = await self._texts.__anext__()
            except StopAsyncIteration:
                self._ended = True
                # A last event without its closing blank line still counts.
                self._decoded([*self._lines.flush(), ""])
                continue
            self._decoded(self._lines.decode(text))
        return batch.popleft()

    async def aclose(self) -> None:
        await self._texts.aclose()  # type: ignore[attr-defined]


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
        self._events = _Events(response)
        self._done = False
        self._finished = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def _next_event(self) -> tuple[str, str] | None:
        try:
            return await self._events.next()
        except HTTPX_ERRORS as exc:
            self._done = True
            raise await self._engine_error(exc) from exc

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
        await self._events.aclose()
        raise StopAsyncIteration
