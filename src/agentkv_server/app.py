"""The Starlette app: the Anthropic Messages API (and OpenAI's Responses and Chat Completions) in
front of an agentkv runtime.

This layer keeps to HTTP (routes, authentication, body limits, agent identity, framing); a
request's whole life is the runtime's (:mod:`agentkv.runtime.lifecycle`). The OpenAI routes
translate their body into a Messages body first and the events back into their own stream, and
answer errors in OpenAI's shape.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agentkv.anthropic_sse import anthropic_events, encode_event
from agentkv.exceptions import (
    AgentKVError,
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
)
from agentkv.openai_sse import (
    CHAT_DONE,
    CHAT_KEEPALIVE,
    ChatAssembler,
    ResponsesAssembler,
    encode_chat_chunk,
    encode_response_event,
    openai_error,
)
from agentkv.openai_translate import OpenAIRequest, OpenAITranslator
from agentkv.reply import ReplyEvent
from agentkv.runtime.lifecycle import Emitted, Exchange, Failed, KeepAlive, Prepared, Runtime
from agentkv.snapshot import unstructure
from agentkv_server.body import read_json
from agentkv_server.config import ServerConfig
from agentkv_server.identity import (
    agent_identity,
    agent_priority,
    codex_subagent,
    openai_agent_identity,
    subagent_id,
)
from agentkv_server.metrics import ServerMetrics

T = TypeVar("T")
_Assembler = TypeVar("_Assembler", ResponsesAssembler, ChatAssembler)

__all__ = ["create_app", "error_response"]

log = logging.getLogger("agentkv.server")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_PING = encode_event({"type": "ping"})


def error_response(exc: AgentKVError, *, openai: bool = False) -> JSONResponse:
    """The Anthropic error contract: the status code and ``{"type":"error","error":{...}}``,
    and ``retry-after`` (whole seconds) when the error says when to try again. ``openai``: the
    same in OpenAI's shape, ``{"error":{"message","type","param","code"}}``."""
    headers = None
    if exc.retry_after is not None:
        headers = {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    body = openai_error(exc) if openai else exc.to_anthropic()
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _speaks_openai(path: str) -> bool:
    """Whether ``path`` is a route that speaks OpenAI's API, and answers errors in its shape."""
    return path.rstrip("/") in ("/v1/responses", "/v1/chat/completions")


async def _frames(exchange: Exchange) -> AsyncIterator[bytes]:
    """The exchange's events as SSE frames; an error after the 200 is an ``error`` event."""
    async for item in exchange.events():
        if isinstance(item, Emitted):
            yield b"".join(encode_event(event) for event in anthropic_events(item.events))
        elif isinstance(item, KeepAlive):
            yield _PING
        elif isinstance(item, Failed):
            yield encode_event(item.error.to_anthropic())


async def _response_frames(
    exchange: Exchange, assembler: ResponsesAssembler
) -> AsyncIterator[bytes]:
    """The exchange as Responses events; keep-alives are ``response.in_progress`` events."""
    async for item in exchange.events():
        if isinstance(item, Emitted):
            events = assembler.feed(item.events)
        elif isinstance(item, KeepAlive):
            events = assembler.keep_alive()
        else:
            events = assembler.fail(item.error)
        if events:
            yield b"".join(encode_response_event(event) for event in events)


async def _chat_frames(exchange: Exchange, assembler: ChatAssembler) -> AsyncIterator[bytes]:
    """The exchange as Chat Completions chunks, then ``[DONE]``; keep-alives are comments."""
    async for item in exchange.events():
        if isinstance(item, Emitted):
            chunks = assembler.feed(item.events)
        elif isinstance(item, KeepAlive):
            yield CHAT_KEEPALIVE
            continue
        else:
            chunks = assembler.fail(item.error)
        if chunks:
            yield b"".join(encode_chat_chunk(chunk) for chunk in chunks)
    yield CHAT_DONE


async def _all_events(exchange: Exchange) -> list[ReplyEvent]:
    """Every event of the exchange's reply (non-streaming); raises the error that ended it."""
    events: list[ReplyEvent] = []
    async for item in exchange.events(ping_interval=3600):
        if isinstance(item, Emitted):
            events.extend(item.events)
        elif isinstance(item, Failed):
            raise item.error
    return events


async def _answer(
    request: Request, work: Awaitable[T], answer: Callable[[T], Response]
) -> Response:
    """``answer(await work)``; 499 when the client disconnects first (nobody reads that), and
    ``work`` is cancelled: an abandoned count never reaches the engine's templating queue, an
    abandoned reply is no longer waited for."""
    value: T | None = None
    error: AgentKVError | None = None

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, tg.cancel_scope)
        try:
            value = await work
        except AgentKVError as exc:  # raised below, not wrapped in a task group's error
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return Response(status_code=499) if value is None else answer(value)


class _Routes:
    """The route handlers, around one runtime."""

    def __init__(self, runtime: Runtime, config: ServerConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.metrics = ServerMetrics(runtime)
        self.openai = OpenAITranslator(limits=runtime.translator.limits)

    def check_auth(self, request: Request) -> None:
        expected = self.config.api_key
        if not expected:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
            raise AuthenticationError("invalid x-api-key")

    async def messages(self, request: Request) -> Response:
        self.check_auth(request)
        body = await read_json(request, self.config.body_limits)
        headers = _lower(request.headers)
        root = agent_identity(headers, body, request.client.host if request.client else None)
        place = self.runtime.place_agent(root, subagent_id(headers), agent_priority(headers), body)
        prepared = await self.runtime.prepare(body, agent=place.agent, priority=place.priority)
        exchange = self.runtime.submit(prepared)  # 529 when the queue is full
        if prepared.engine.stream:
            return StreamingResponse(
                _frames(exchange), media_type="text/event-stream", headers=_SSE_HEADERS
            )
        try:
            return await _answer(request, exchange.message(), JSONResponse)
        except AgentKVError as exc:
            return error_response(exc)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (Codex, the openai SDK): translated, then the same lifecycle."""
        return await self._openai(
            request,
            self.openai.responses,
            lambda translated: ResponsesAssembler(translated, created_at=int(time.time())),
            _response_frames,
            lambda assembler: assembler.response,
        )

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: translated, then the same lifecycle."""
        return await self._openai(
            request,
            self.openai.chat,
            lambda translated: ChatAssembler(translated, created=int(time.time())),
            _chat_frames,
            lambda assembler: assembler.completion,
        )

    async def _openai(
        self,
        request: Request,
        translate: Callable[[Mapping[str, Any]], OpenAIRequest],
        assembler_for: Callable[[OpenAIRequest], _Assembler],
        frames: Callable[[Exchange, _Assembler], AsyncIterator[bytes]],
        whole: Callable[[_Assembler], dict[str, Any]],
    ) -> Response:
        """An OpenAI route: translate, run like a Messages request, answer in the route's shape."""
        self.check_auth(request)
        body = await read_json(request, self.config.body_limits)
        translated = translate(body)
        exchange = self.runtime.submit(await self._prepare_openai(request, body, translated))
        assembler = assembler_for(translated)
        if translated.stream:
            return StreamingResponse(
                frames(exchange, assembler), media_type="text/event-stream", headers=_SSE_HEADERS
            )

        def answer(events: list[ReplyEvent]) -> Response:
            assembler.feed(events)
            return JSONResponse(whole(assembler))

        return await _answer(request, _all_events(exchange), answer)

    async def _prepare_openai(
        self, request: Request, body: Mapping[str, Any], translated: OpenAIRequest
    ) -> Prepared:
        """``Runtime.prepare`` for a translated body; a 400 names the client's own field."""
        headers = _lower(request.headers)
        spawned = codex_subagent(headers)
        if spawned is None:
            client = request.client.host if request.client else None
            root, sub = openai_agent_identity(headers, body, client), None
        else:
            root, sub = spawned
        place = self.runtime.place_agent(root, sub, agent_priority(headers), translated.body)
        try:
            return await self.runtime.prepare(
                translated.body, agent=place.agent, priority=place.priority
            )
        except InvalidRequestError as exc:
            param = translated.relocate(exc.path)
            if param == exc.path:
                raise
            detail = exc.message.removeprefix(f"{exc.path}: ") if exc.path else exc.message
            raise InvalidRequestError(detail, param) from exc

    async def count_tokens(self, request: Request) -> Response:
        self.check_auth(request)
        body = await read_json(request, self.config.body_limits)
        counting = self.runtime.admission.count_tokens(body)
        return await _answer(
            request, counting, lambda tokens: JSONResponse({"input_tokens": tokens})
        )

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        status = self.runtime.client.status
        if status is not None and (unavailable := status.error()) is not None:
            # No model is served while the engine restarts or after agentkv gave up on it.
            raise unavailable
        entry = {
            "type": "model",
            "id": self.config.model_name,
            "display_name": self.config.model_name,
            "created_at": "2025-01-01T00:00:00Z",
            # The same list read by OpenAI clients (OpenCode, Aider, the openai SDK).
            "object": "model",
            "created": 1735689600,
            "owned_by": "agentkv",
        }
        return JSONResponse(
            {
                "object": "list",
                "data": [entry],
                "has_more": False,
                "first_id": entry["id"],
                "last_id": entry["id"],
            }
        )

    async def health(self, request: Request) -> Response:
        """200 ``ready``; 503 ``engine_restarting`` (with ``retry-after``) or
        ``engine_unavailable``."""
        client = self.runtime.client
        state, detail = await client.engine_state()
        body: dict[str, Any] = {
            "status": state,
            "engine": state == "ready",
            "slots": self.runtime.config.n_slots,
            "queued": self.runtime.dispatcher.queue_depth,
        }
        headers = None
        if client.status is not None:
            body["engine_generation"] = client.status.generation
            body["engine_restarts"] = client.status.restarts
        elif client.engines() is not None:
            # A pool of engines: every engine's restarts (each has its own generation).
            body["engine_restarts"] = client.restarts
        if state != "ready":
            body["detail"] = detail
        if state == "engine_restarting" and client.status is not None:
            headers = {"retry-after": str(max(1, math.ceil(client.status.retry_after)))}
        return JSONResponse(body, status_code=200 if state == "ready" else 503, headers=headers)

    async def slots(self, request: Request) -> Response:
        """``GET /agentkv/slots``: the runtime's snapshot, unstructured (docs/observability.md)."""
        self.check_auth(request)
        return JSONResponse(unstructure(self.runtime.snapshot()))

    async def clear_store(self, request: Request) -> Response:
        """``DELETE /agentkv/store`` (``?agent=ID`` for one agent): delete saved KV states."""
        self.check_auth(request)
        agent = request.query_params.get("agent") or None
        if self.runtime.store is None:
            return JSONResponse({"deleted": 0, "store": "off"})
        deleted = await self.runtime.contents.clear(agent=agent)
        return JSONResponse({"deleted": deleted, "agent": agent})

    async def prometheus(self, request: Request) -> Response:
        self.check_auth(request)
        return self.metrics.response()


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


async def _agentkv_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AgentKVError)
    metrics = getattr(request.app.state, "metrics", None)
    if isinstance(metrics, ServerMetrics):
        metrics.refuse(request.url.path, exc)
    return error_response(exc, openai=_speaks_openai(request.url.path))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFoundError(f"no route for {request.method} {request.url.path}"))
    if exc.status_code == 405:
        err = InvalidRequestError(f"method {request.method} is not allowed on {request.url.path}")
        body = openai_error(err) if _speaks_openai(request.url.path) else err.to_anthropic()
        return JSONResponse(body, status_code=405)
    return JSONResponse(
        {"type": "error", "error": {"type": "api_error", "message": str(exc.detail)}},
        status_code=exc.status_code,
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected error in %s", request.url.path, exc_info=exc)
    error = AgentKVError("internal error in agentkv; see the server log")
    return error_response(error, openai=_speaks_openai(request.url.path))


def create_app(
    runtime: Runtime,
    config: ServerConfig | None = None,
    *,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> Starlette:
    """The ASGI app around a runtime; its lifespan runs the runtime. The caller owns the engine."""
    config = config or ServerConfig()
    routes = _Routes(runtime, config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with runtime:
                yield
        finally:
            if on_shutdown is not None:
                with anyio.CancelScope(shield=True):
                    await on_shutdown()

    app = Starlette(
        routes=[
            Route("/v1/messages", routes.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/agentkv/slots", routes.slots, methods=["GET"]),
            Route("/agentkv/store", routes.clear_store, methods=["DELETE"]),
            Route("/metrics", routes.prometheus, methods=["GET"]),
            # The live page, shipped as package data (``static/``: HTML, JS and CSS, no build
            # step, nothing fetched from elsewhere). Its files hold no data, so they are served
            # without the API key (a browser cannot send ``x-api-key`` when it loads a page);
            # the page polls /agentkv/slots with the key, which it asks for once and keeps in
            # the tab's sessionStorage. After the /agentkv/… routes, which it would shadow.
            Mount(
                "/agentkv",
                StaticFiles(packages=[("agentkv_server", "static")], html=True),
                name="page",
            ),
        ],
        lifespan=lifespan,
        middleware=[Middleware(_host_check, config=config)] if config.allowed_hosts else [],
        exception_handlers={
            AgentKVError: _agentkv_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.runtime = runtime
    app.state.metrics = routes.metrics
    return app


def _host_check(app: Any, config: ServerConfig) -> Any:
    """Refuses a request whose ``Host`` is not one the server answers to (DNS rebinding: a web
    page that makes a browser send requests to a name that resolves to 127.0.0.1)."""

    async def check(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = next(
                (v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None
            )
            if not config.host_allowed(host):
                error = InvalidRequestError(
                    f"Host {host!r} is not one this server answers to (--allowed-hosts)"
                )
                openai = _speaks_openai(str(scope.get("path", "")))
                await error_response(error, openai=openai)(scope, receive, send)
                return
        await app(scope, receive, send)

    return check
