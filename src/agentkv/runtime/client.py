"""LlamaSlotClient: the one place agentkv talks HTTP to llama-server.

Every request to the engine goes through here, so every upstream failure is mapped once, at this
boundary, onto the agentkv exception tree: unreachable → :class:`EngineUnavailableError`, stalled →
:class:`EngineTimeoutError`, error status or unparseable body → :class:`EngineResponseError`.

Requests are retried only where a retry cannot repeat work: the connection was refused or could not
be opened, or llama-server answered 503 because it is still loading the model. Nothing is retried
once a response body has started to reach the caller.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from agentkv.exceptions import (
    EngineError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
)

__all__ = ["LlamaSlotClient"]

_CHAT_PATH = "/v1/chat/completions"
# Opening a TCP connection to a local server never legitimately takes long; a slow connect means
# the host is wrong or the server is wedged, and the caller should hear about it quickly.
_CONNECT_TIMEOUT = 10.0


class _NotReadyError(EngineUnavailableError):
    """Raised for the retryable cases only: refused/failed connection or 503 while loading."""


def _error_message(response: httpx.Response) -> str:
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


def _status_error(response: httpx.Response, what: str) -> EngineError:
    """The agentkv error for a non-2xx answer (the body must already be read)."""
    message = (
        f"llama-server {what} failed with HTTP {response.status_code}: {_error_message(response)}"
    )
    if response.status_code == 503:
        # llama-server answers 503 while it loads the model; the request was not processed.
        return _NotReadyError(message)
    return EngineResponseError(message, upstream_status=response.status_code)


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise EngineResponseError(f"llama-server {what} returned malformed JSON: {exc}") from exc


def _check_chunk(chunk: Any) -> dict[str, Any]:
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


def _finish_reason(chunk: Mapping[str, Any]) -> Any:
    if chunk.get("stop") is True:  # llama-server's native /completion stream
        return chunk.get("stop_type") or "stop"
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0].get("finish_reason")
    return None


class _ChunkStream:
    """Async iterator over the chunk dicts of one streamed chat completion.

    Ends at ``data: [DONE]``. A stream that stops before ``[DONE]`` without having reported a
    ``finish_reason`` is truncated and raises :class:`EngineResponseError`.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()
        self._done = False
        self._finished = False

    def __aiter__(self) -> _ChunkStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                self._done = True
                if self._finished:
                    raise StopAsyncIteration from None
                raise EngineResponseError(
                    "llama-server stream ended before the completion finished (truncated)"
                ) from None
            except httpx.TimeoutException as exc:
                self._done = True
                raise EngineTimeoutError(f"llama-server stopped streaming: {exc!r}") from exc
            except httpx.TransportError as exc:
                self._done = True
                raise EngineResponseError(
                    f"llama-server connection broke mid-stream (truncated): {exc!r}"
                ) from exc
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.strip()
            if field == "error":
                # Some llama-server versions report failures as an `error:` SSE field.
                self._done = True
                _check_chunk({"error": _parse_json(value, "stream")})
            if field != "data":
                continue
            if value == "[DONE]":
                self._done = True
                raise StopAsyncIteration
            try:
                chunk = _check_chunk(_parse_json(value, "stream"))
            except EngineError:
                self._done = True
                raise
            if _finish_reason(chunk) is not None:
                self._finished = True
            return chunk


class LlamaSlotClient:
    """Async client for llama-server that pins chat requests to a slot and maps every failure.

    ``http`` may be injected (tests use ``httpx.MockTransport``); a client created here is closed by
    :meth:`aclose`. ``connect_retries`` and ``retry_seconds`` bound the safe retries (refused
    connection, 503 while loading); ``read_timeout`` is how long llama-server may stay silent
    mid-request before :class:`EngineTimeoutError`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        connect_retries: int = 5,
        retry_seconds: float = 30.0,
        read_timeout: float = 600.0,
        retry_backoff: float = 0.25,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._owns_http = http is None
        self._timeout = httpx.Timeout(read_timeout, connect=_CONNECT_TIMEOUT)
        self._http = http if http is not None else httpx.AsyncClient(timeout=self._timeout)
        self._connect_retries = max(0, connect_retries)
        self._retry_seconds = retry_seconds
        self._retry_backoff = retry_backoff

    # -- chat ---------------------------------------------------------------------------------

    @staticmethod
    def _chat_body(body: Mapping[str, Any], slot: int | None, *, stream: bool) -> dict[str, Any]:
        # id_slot pins the request to the slot whose KV cache holds its prefix; cache_prompt lets
        # llama-server reuse that cache instead of recomputing the whole prompt.
        return {
            **body,
            "stream": stream,
            "id_slot": -1 if slot is None else slot,
            "cache_prompt": True,
        }

    async def chat(self, body: Mapping[str, Any], *, slot: int | None) -> dict[str, Any]:
        """Non-streaming chat completion on ``slot`` (None: any idle slot); the JSON reply with
        ``timings``."""
        payload = self._chat_body(body, slot, stream=False)
        data = await self._request_json("POST", _CHAT_PATH, "chat completion", json_body=payload)
        if not isinstance(data, dict):
            raise EngineResponseError(f"llama-server chat completion returned {data!r:.200}")
        return data

    @contextlib.asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, slot: int | None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Streaming chat completion on ``slot``; yields an iterator of parsed chunk dicts.

        Leaving the ``async with`` block (also by cancellation) closes the upstream response, which
        makes llama-server stop generating and free the slot.
        """
        payload = self._chat_body(body, slot, stream=True)
        response = await self._send("POST", _CHAT_PATH, "chat completion", payload, stream=True)
        try:
            yield _ChunkStream(response)
        finally:
            # Shielded: closing must happen even when the caller is being cancelled, or the
            # engine would keep generating into a connection nobody reads.
            with anyio.CancelScope(shield=True):
                await response.aclose()

    # -- prompt accounting --------------------------------------------------------------------

    async def tokenize(self, content: str, *, add_special: bool = False) -> list[int]:
        """Token ids of ``content``; special-token text (``<|im_start|>``) is parsed as such."""
        data = await self._request_json(
            "POST",
            "/tokenize",
            "tokenize",
            json_body={"content": content, "add_special": add_special, "parse_special": True},
        )
        tokens = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(tokens, list):
            raise EngineResponseError(f"llama-server tokenize returned {data!r:.200}")
        # With with_pieces the entries are objects; we never ask for that, so ints are expected.
        return [int(t["id"]) if isinstance(t, Mapping) else int(t) for t in tokens]

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt text llama-server's chat template makes of a chat ``body``."""
        data = await self._request_json(
            "POST", "/apply-template", "apply-template", json_body=dict(body)
        )
        prompt = data.get("prompt") if isinstance(data, Mapping) else None
        if not isinstance(prompt, str):
            raise EngineResponseError(f"llama-server apply-template returned {data!r:.200}")
        return prompt

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt tokens of a chat ``body``, exactly as llama-server computes them."""
        prompt = await self.apply_template(body)
        # llama-server tokenizes the templated chat prompt with add_special=True and
        # parse_special=True; the chat template already wrote any BOS the model wants.
        return await self.tokenize(prompt, add_special=True)

    async def count_prompt_tokens(self, body: Mapping[str, Any]) -> int:
        """How many prompt tokens a chat ``body`` costs, as llama-server counts them
        (``timings.prompt_n + timings.cache_n`` of a real request)."""
        return len(await self.prompt_tokens(body))

    @contextlib.asynccontextmanager
    async def prefill(
        self, tokens: list[int] | tuple[int, ...], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Compute ``tokens`` into ``slot``'s cache and generate nothing worth keeping.

        A streamed ``/completion`` of the raw token ids with one predicted token (llama-server
        always samples at least one) and prompt progress on: the chunks report
        ``prompt_progress`` while it computes, and the last one its ``timings``. The slot then
        holds ``tokens``, ready to be saved or extended by the real request. Leaving the block
        early cancels the computation; the slot keeps what was computed so far.
        """
        payload = {
            "prompt": list(tokens),
            "n_predict": 1,
            "id_slot": slot,
            "cache_prompt": True,
            "stream": True,
            "return_progress": True,
            "temperature": 0.0,
        }
        response = await self._send("POST", "/completion", "prefill", payload, stream=True)
        try:
            yield _ChunkStream(response)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    # -- slots --------------------------------------------------------------------------------

    async def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``: one dict per slot (``id``, ``n_ctx``, ``is_processing``, ...)."""
        data = await self._request_json("GET", "/slots", "slots")
        if not isinstance(data, list):
            raise EngineResponseError(f"llama-server /slots returned {data!r:.200}")
        return data

    async def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Write ``slot``'s KV cache to ``filename`` inside llama-server's ``--slot-save-path``."""
        return await self._slot_action(slot, "save", {"filename": filename})

    async def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Load ``slot``'s KV cache from ``filename`` (saved earlier by :meth:`save_slot`)."""
        return await self._slot_action(slot, "restore", {"filename": filename})

    async def erase_slot(self, slot: int) -> dict[str, Any]:
        """Drop ``slot``'s KV cache."""
        return await self._slot_action(slot, "erase", {})

    async def _slot_action(self, slot: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        data = await self._request_json(
            "POST",
            f"/slots/{int(slot)}",
            f"slot {action}",
            json_body=body,
            params={"action": action},
        )
        if not isinstance(data, dict):
            raise EngineResponseError(f"llama-server slot {action} returned {data!r:.200}")
        return data

    # -- readiness ----------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when llama-server is up and has loaded its model (one probe, no retries)."""
        state, _ = await probe(self._http, self.base_url)
        return state == "ready"

    async def wait_ready(
        self,
        timeout: float,  # noqa: ASYNC109 - part of the public contract
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Poll ``/health`` until the model is loaded; :class:`EngineUnavailableError` after
        ``timeout`` seconds. ``on_progress`` hears each change of state in words."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            state, detail = await probe(self._http, self.base_url)
            if state == "ready":
                if on_progress is not None:
                    on_progress(f"llama-server at {self.base_url} is ready")
                return
            message = f"llama-server at {self.base_url}: {detail}"
            if on_progress is not None and message != last:
                on_progress(message)
            last = message
            if time.monotonic() >= deadline:
                raise EngineUnavailableError(f"{message} (still not ready after {timeout:g} s)")
            await anyio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> LlamaSlotClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- transport ----------------------------------------------------------------------------

    async def _request_json(
        self,
        method: str,
        path: str,
        what: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        response = await self._send(method, path, what, json_body, params=params)
        return _parse_json(response.text, what)

    async def _send(
        self,
        method: str,
        path: str,
        what: str,
        json_body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send one request, retrying only the safe cases; a 2xx response or an agentkv error.

        With ``stream=True`` the returned response body is unread and the caller must close it.
        """
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._connect_retries + 1)
            | stop_after_delay(self._retry_seconds),
            wait=wait_exponential(multiplier=self._retry_backoff, max=2.0),
            retry=retry_if_exception_type(_NotReadyError),
            sleep=anyio.sleep,
            reraise=True,
        )
        try:
            return await retrying(self._send_once, method, path, what, json_body, params, stream)
        except _NotReadyError as exc:
            # Callers see the public type; the private subclass only steers the retries.
            raise EngineUnavailableError(exc.message) from exc.__cause__

    async def _send_once(
        self,
        method: str,
        path: str,
        what: str,
        json_body: Any,
        params: Mapping[str, str] | None,
        stream: bool,
    ) -> httpx.Response:
        request = self._http.build_request(
            method, self.base_url + path, json=json_body, params=params, timeout=self._timeout
        )
        try:
            response = await self._http.send(request, stream=stream)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Nothing reached llama-server, so trying again cannot duplicate work.
            raise _NotReadyError(f"cannot reach llama-server at {self.base_url}: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeoutError(
                f"llama-server {what} timed out at {self.base_url}: {exc!r}"
            ) from exc
        except httpx.TransportError as exc:
            raise EngineUnavailableError(
                f"llama-server {what} failed at {self.base_url}: {exc!r}"
            ) from exc
        if response.is_success:
            return response
        try:
            await response.aread()
        except httpx.HTTPError:
            pass
        finally:
            await response.aclose()
        raise _status_error(response, what)


async def probe(http: httpx.AsyncClient, base_url: str) -> tuple[str, str]:
    """One ``GET /health``: ``("ready" | "loading" | "down", detail in words)``."""
    try:
        response = await http.get(f"{base_url.rstrip('/')}/health", timeout=5.0)
    except httpx.ConnectError:
        return "down", "not accepting connections yet"
    except httpx.HTTPError as exc:
        return "down", f"health check failed ({exc!r})"
    if response.status_code == 200:
        return "ready", "ready"
    if response.status_code == 503:
        return "loading", f"loading the model ({_error_message(response)})"
    return "down", f"health check answered HTTP {response.status_code}: {_error_message(response)}"
