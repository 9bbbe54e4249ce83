"""The engine link's one error map: every httpx failure and every error status of llama-server
becomes an error of the agentkv tree (:mod:`agentkv.exceptions`), in one place.

:data:`HTTPX_ERROR_MAP` is the table (like httpx's own ``HTTPCORE_EXC_MAP``), and
:func:`map_httpx_error` applies it. Two private kinds steer the client's retries and never reach a
caller: :class:`NotReadyError` (nothing reached llama-server: retried with backoff) and
:class:`DroppedError` (the connection closed before the reply: sent once more).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from agentkv.exceptions import (
    EngineError,
    EngineResponseError,
    EngineStreamBrokenError,
    EngineTimeoutError,
    EngineUnavailableError,
)

__all__ = [
    "GATEWAY_STATUSES",
    "HTTPX_ERRORS",
    "HTTPX_ERROR_MAP",
    "DroppedError",
    "NotReadyError",
    "error_message",
    "map_httpx_error",
    "parse_json",
    "status_error",
]


class NotReadyError(EngineUnavailableError):
    """Raised for the retryable cases only: refused/failed connection or 503 while loading."""


class DroppedError(EngineUnavailableError):
    """The connection closed before any byte of the response arrived (or, for a call that is
    safe to repeat, while its reply was read): sent once more on a new connection."""


#: Statuses from something between agentkv and llama-server (a proxy) that say nothing about the
#: request itself; a call that is safe to repeat is sent once more.
GATEWAY_STATUSES = frozenset({502, 504})

#: How llama-server refuses an image for a model without a multimodal projector.
_NO_IMAGES_WORDS = "image input is not supported"


#: Every httpx failure, most specific first, and the agentkv error it becomes, with words for the
#: message. The first entry the exception is an instance of wins (like httpx's own
#: ``HTTPCORE_EXC_MAP``). ``NotReadyError`` is retried: nothing reached llama-server.
HTTPX_ERROR_MAP: tuple[tuple[type[Exception], type[EngineError], str], ...] = (
    (httpx.ConnectTimeout, NotReadyError, "cannot reach llama-server (connect timed out)"),
    (httpx.ConnectError, NotReadyError, "cannot reach llama-server"),
    # No pooled connection came free in time: too many requests are in flight already.
    (httpx.PoolTimeout, EngineUnavailableError, "no free connection to llama-server"),
    # Read or write timeout: llama-server accepted the request and then went silent.
    (httpx.TimeoutException, EngineTimeoutError, "llama-server timed out"),
    # The connection closed or was reset before the response: on a pooled connection, llama-server
    # had closed it after a stream; sent once more on a new connection.
    (httpx.RemoteProtocolError, DroppedError, "llama-server dropped the connection"),
    (httpx.LocalProtocolError, EngineError, "agentkv sent llama-server an invalid request"),
    (httpx.ReadError, DroppedError, "the connection to llama-server broke"),
    (httpx.WriteError, DroppedError, "the connection to llama-server broke"),
    (httpx.NetworkError, EngineUnavailableError, "the connection to llama-server broke"),
    (httpx.ProxyError, EngineUnavailableError, "a proxy refused the way to llama-server"),
    (httpx.UnsupportedProtocol, EngineUnavailableError, "the llama-server URL is not http(s)"),
    (httpx.TransportError, EngineUnavailableError, "the connection to llama-server failed"),
    (httpx.DecodingError, EngineResponseError, "llama-server sent an undecodable body"),
    (httpx.TooManyRedirects, EngineResponseError, "llama-server redirected too often"),
    (httpx.HTTPStatusError, EngineResponseError, "llama-server answered with an error status"),
    (httpx.InvalidURL, EngineUnavailableError, "the llama-server URL is invalid"),
    (httpx.StreamError, EngineError, "agentkv misread a llama-server response"),
    (httpx.HTTPError, EngineError, "the request to llama-server failed"),
)
#: The httpx exceptions the map covers (what a ``try`` at the boundary catches).
HTTPX_ERRORS = tuple(kind for kind, _, _ in HTTPX_ERROR_MAP)


def map_httpx_error(exc: Exception, what: str, base_url: str, *, started: bool) -> EngineError:
    """The agentkv error for an httpx failure of request ``what`` (the one mapping).

    ``started``: the response body had begun to reach the caller. A connection lost then is a
    truncated reply (never retried), not an unreachable engine.
    """
    error, words = next(
        ((error, words) for kind, error, words in HTTPX_ERROR_MAP if isinstance(exc, kind)),
        (EngineError, "the request to llama-server failed"),
    )
    message = f"{words} ({what} at {base_url}): {exc!r}"
    if started and issubclass(error, EngineUnavailableError):
        return EngineStreamBrokenError(f"{message}; the reply is truncated")
    return error(message)


def error_message(response: httpx.Response) -> str:
    """llama-server's own error text (``{"error": {"message": ...}}``), else the raw body."""
    text = response.text
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or response.reason_phrase
    if isinstance(data, Mapping):
        error = data.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return text.strip()[:500]


def status_error(response: httpx.Response, what: str) -> EngineError:
    """The agentkv error for a non-2xx answer (the body must already be read)."""
    message = (
        f"llama-server {what} failed with HTTP {response.status_code}: {error_message(response)}"
    )
    if response.status_code == 503:
        # llama-server answers 503 while it loads the model; the request was not processed.
        return NotReadyError(message)
    if _NO_IMAGES_WORDS in message:
        # llama-server answers an image for a model without vision with a 500; it is the
        # request that cannot be served (reached only where /props did not say so first).
        return EngineResponseError(f"this model does not accept images: {message}", 400)
    return EngineResponseError(message, upstream_status=response.status_code)


def parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise EngineResponseError(f"llama-server {what} returned malformed JSON: {exc}") from exc
