"""The Starlette app: Anthropic Messages API in front of llama-server slots.

The routes hold no state of their own. Per-engine state (slots, queue, counters) lives in the
``Gateway``; per-request state lives in one ``_Exchange`` and dies with it.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agentkv import (
    AgentKVError,
    EngineError,
    Fingerprint,
    InvalidRequestError,
    Lease,
    LlamaSlotClient,
    MessagesTranslator,
    PrefixFingerprinter,
    PromptTooLongError,
    SSEAssembler,
    Ticket,
)
from agentkv.exceptions import AuthenticationError, NotFoundError, RequestTooLargeError
from agentkv.parking import ParkingLot
from agentkv.runtime.compactor import Compactor
from agentkv.runtime.gateway import Gateway, RequestRecord
from agentkv.sse import RetryWithTools, accumulate, encode_event
from agentkv.translate import EngineRequest
from agentkv_server.config import ServerConfig
from agentkv_server.identity import agent_identity, agent_priority

__all__ = ["AgentKV", "create_app", "error_response"]

log = logging.getLogger("agentkv.server")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


#: What the engine task sends the relay: a chunk, the error that ended the request, or an event
#: that the relay sets once it has fed everything sent before it (the end of one engine reply).
_Item = dict[str, Any] | AgentKVError | anyio.Event


def error_response(exc: AgentKVError) -> JSONResponse:
    """The Anthropic error contract: the status code and ``{"type":"error","error":{...}}``."""
    return JSONResponse(exc.to_anthropic(), status_code=exc.status)


@attrs.define
class _Exchange:
    """One /v1/messages request on its way through queue, slot and engine."""

    app: AgentKV
    engine_request: EngineRequest
    agent: str
    priority: int
    ticket: Ticket
    record: RequestRecord
    assembler: SSEAssembler
    started: float
    published: bool = False

    async def run(
        self,
        emit: Callable[[list[dict[str, Any]]], Awaitable[None]],
        idle: Callable[[], Awaitable[None]],
    ) -> AgentKVError | None:
        """Drive the request to its end. ``emit`` gets events; ``idle`` is called on silence.

        Returns the error that ended the request early, if any; the events before it were emitted.
        The request is recorded in the slot table *before* its last events go out, so a client
        that has its reply can already see it there.
        """
        app, asm = self.app, self.assembler
        await emit(asm.start())
        send, receive = anyio.create_memory_object_stream[_Item](max_buffer_size=256)
        failure: AgentKVError | None = None
        last: list[dict[str, Any]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._engine, send)
            try:
                async with receive:
                    await self._relay(receive, emit, idle)
                now = app.clock()
                if self.record.ttft_s is None:  # a held tool call arrives only at the end
                    self.record.ttft_s = round(now - self.started, 4)
                last = asm.finish(now)
            except AgentKVError as exc:
                # From the engine task, or from the assembler refusing what the engine sent.
                failure = exc
            tg.cancel_scope.cancel()
        usage = asm.usage
        self.record.prompt_tokens = int(usage.get("input_tokens", 0) or 0)
        self.record.cached_tokens = int(usage.get("cache_read_input_tokens", 0) or 0)
        self.record.output_tokens = int(usage.get("output_tokens", 0) or 0)
        self.record.status = "ok" if failure is None else f"error: {failure.error_type}"
        self.publish()
        await emit(last)
        return failure

    def publish(self) -> None:
        """Add this request to the slot table's history, once."""
        if not self.published:
            self.published = True
            self.app.gateway.record(self.record)

    async def _relay(
        self,
        receive: anyio.abc.ObjectReceiveStream[_Item],
        emit: Callable[[list[dict[str, Any]]], Awaitable[None]],
        idle: Callable[[], Awaitable[None]],
    ) -> None:
        """Feed engine chunks to the assembler until the engine is done; raise what failed it."""
        app, asm, config = self.app, self.assembler, self.app.config
        last_sent = app.clock()
        while True:
            # Wake up at least as often as the coalescing bound, so buffered text flows.
            with anyio.move_on_after(min(config.ping_interval, config.coalesce_seconds or 1)):
                try:
                    item = await receive.receive()
                except anyio.EndOfStream:
                    return
                if isinstance(item, AgentKVError):
                    raise item
                if isinstance(item, anyio.Event):
                    item.set()  # every chunk of the engine's reply has been fed
                    continue
                now = app.clock()
                events = asm.feed(item, now)
                if events:
                    if self.record.ttft_s is None:
                        self.record.ttft_s = round(now - self.started, 4)
                    await emit(events)
                    last_sent = now
                continue
            now = app.clock()
            events = asm.flush(now)
            if events:
                await emit(events)
                last_sent = now
            elif now - last_sent >= config.ping_interval:
                await idle()
                last_sent = now

    async def _stream(
        self, send: anyio.abc.ObjectSendStream[_Item], body: dict[str, Any], lease: Lease
    ) -> None:
        """Relay one engine stream, and return once the relay has fed all of it.

        The stream is closed early when the assembler asks to stop (a degenerate loop): leaving
        the ``async with`` closes the connection, and llama-server stops generating.
        """
        async with self.app.client.stream(body, slot=lease.slot) as chunks:
            async for chunk in chunks:
                if chunk.get("choices") or chunk.get("timings"):
                    # Output has begun (or the reply is done): the slot is no longer up for grabs.
                    self.app.gateway.started(lease)
                await send.send(chunk)
                if self.assembler.stop is not None:
                    log.warning("agent %s: %s", self.agent, self.assembler.stop.message)
                    break
        fed = anyio.Event()
        await send.send(fed)
        await fed.wait()

    async def _engine(self, send: anyio.abc.ObjectSendStream[_Item]) -> None:
        app = self.app
        ticket = self.ticket
        async with send:
            try:
                while not await self._attempt(send, ticket):
                    # Pre-empted by a P0 request before producing anything: queue again, keeping
                    # the original arrival (and so the aging credit).
                    self.record.preempted += 1
                    self.record.status = "queued"
                    ticket = app.gateway.submit(
                        ticket.agent, ticket.priority, ticket.fingerprint, arrival=ticket.arrival
                    )
            except AgentKVError as exc:
                log.warning("request of agent %s failed: %s", self.agent, exc.message)
                await send.send(exc)

    async def _attempt(self, send: anyio.abc.ObjectSendStream[_Item], ticket: Ticket) -> bool:
        """Run the request on a slot; False if it was pre-empted before its first output."""
        app = self.app
        with anyio.CancelScope() as preemption:
            async with app.gateway.hold(ticket) as lease:
                self.record.slot = lease.slot
                self.record.dispatch_seq = app.gateway.dispatch_seq(lease)
                self.record.match = lease.match.kind.value
                self.record.queued_s = round(app.clock() - self.started, 4)
                self.record.status = "running"
                app.gateway.running(lease, ticket.priority, preemption.cancel)
                await self._run_on(send, lease)
        return not preemption.cancelled_caught

    async def _run_on(self, send: anyio.abc.ObjectSendStream[_Item], lease: Lease) -> None:
        app = self.app
        await app.prepare_slot(lease, self.ticket.fingerprint, self.record)
        body = dict(self.engine_request.body)
        body["stream"] = True
        await self._stream(send, body, lease)
        if isinstance(self.assembler.verdict(), RetryWithTools):
            # The reply tried to call a tool and got it wrong: ask once more, with
            # decoding constrained to a valid call of a declared tool.
            self.record.retried = True
            self.assembler.begin_retry()
            forced = app.translator.force_any_tool(self.engine_request, body)
            await self._stream(send, forced, lease)


class _ExchangeResponse(Response):
    """Runs an exchange while listening for the client's disconnect; whichever ends first wins.

    A disconnect cancels the exchange, which closes the engine stream (llama-server stops
    generating) and releases the lease under a shielded scope.
    """

    def __init__(self, exchange: _Exchange, *, stream: bool) -> None:
        self.exchange = exchange
        self.stream = stream
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                record = self.exchange.record
                # A server also reports the disconnect that follows a complete response.
                if record.status in ("queued", "running"):
                    log.info("client of agent %s disconnected", self.exchange.agent)
                    record.status = "disconnected"
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                if self.stream:
                    await self._stream(send)
                else:
                    await self._whole(send)
            finally:
                tg.cancel_scope.cancel()
                self.exchange.publish()  # a disconnected or cancelled request, too

    async def _stream(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    *((k.encode(), v.encode()) for k, v in _SSE_HEADERS.items()),
                ],
            }
        )

        async def emit(events: list[dict[str, Any]]) -> None:
            if events:
                data = b"".join(encode_event(e) for e in events)
                await send({"type": "http.response.body", "body": data, "more_body": True})

        async def idle() -> None:
            await emit([self.exchange.assembler.ping()])

        failure = await self.exchange.run(emit, idle)
        if failure is not None:
            # After a 200 has started, an error travels as an ``error`` event.
            await emit([self.exchange.assembler.error(failure)])
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _whole(self, send: Send) -> None:
        events: list[dict[str, Any]] = []

        async def emit(batch: list[dict[str, Any]]) -> None:
            events.extend(batch)

        async def idle() -> None:
            return None

        failure = await self.exchange.run(emit, idle)
        response: Response
        if failure is not None:
            response = error_response(failure)
        else:
            response = JSONResponse(accumulate(events))
        await response({"type": "http"}, _never_receive, send)


async def _never_receive() -> dict[str, Any]:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@attrs.define
class AgentKV:
    """The app's state: one engine client, one gateway, the pure translators."""

    config: ServerConfig
    client: LlamaSlotClient
    gateway: Gateway
    compactor: Compactor
    fingerprinter: PrefixFingerprinter
    translator: MessagesTranslator = attrs.field(factory=MessagesTranslator)
    parking: ParkingLot = attrs.field(factory=ParkingLot)
    clock: Callable[[], float] = time.monotonic
    _parking_off: bool = False

    async def prepare_slot(
        self, lease: Lease, fingerprint: Fingerprint | None, record: RequestRecord
    ) -> None:
        """Before a request runs on its slot: park the context a miss overwrites, and restore the
        agent's own parked context when it is a longer prefix than what the slot holds."""
        if not self.config.park_contexts or self._parking_off:
            return
        lot = self.parking
        try:
            if lease.evicted_agent is not None and lot.should_park(
                lease.evicted_agent, lease.evicted
            ):
                assert lease.evicted is not None
                await self.client.save_slot(lease.slot, lot.filename(lease.evicted_agent))
                lot.park(lease.evicted_agent, lease.evicted, self.clock())
            parked = lot.best(lease.agent, fingerprint, lease.match.shared_size)
            if parked is not None:
                await self.client.restore_slot(lease.slot, parked.filename)
                record.match = "restored"
        except EngineError as exc:
            # Most likely llama-server runs without --slot-save-path. Requests still work; they
            # just prefill what a parked context would have saved.
            log.warning("parking agent contexts is off: %s", exc.message)
            self._parking_off = True

    # -- helpers ---------------------------------------------------------------------------
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

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise InvalidRequestError("request body is empty; expected a JSON object")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequestError(
                f"request body must be a JSON object, not {type(body).__name__}"
            )
        return body

    # -- routes ----------------------------------------------------------------------------
    async def messages(self, request: Request) -> Response:
        self.check_auth(request)
        body = await self.read_json(request)
        engine_request = self.translator.translate(body)
        headers = _lower(request.headers)
        agent = agent_identity(headers, body, request.client.host if request.client else None)
        priority = agent_priority(headers)
        engine_request, fingerprint, prompt_tokens = await self._fit(
            agent, priority, engine_request
        )
        ticket = self.gateway.submit(agent, priority, fingerprint)  # 529 when the queue is full
        message_id = "msg_" + secrets.token_hex(12)
        assembler = SSEAssembler(
            message_id=message_id,
            model=engine_request.model,
            forced_tool=engine_request.forced_tool,
            tool_names=engine_request.tool_names,
            coalesce_chars=self.config.coalesce_chars,
            coalesce_seconds=self.config.coalesce_seconds,
            input_tokens_hint=prompt_tokens or 0,
            tool_schemas=self._repairable_tools(engine_request),
        )
        exchange = _Exchange(
            app=self,
            engine_request=engine_request,
            agent=agent,
            priority=priority,
            ticket=ticket,
            record=RequestRecord(agent=agent, priority=priority, ticket=ticket.id),
            assembler=assembler,
            started=ticket.arrival,
        )
        log.info(
            "agent=%s priority=%d ticket=%d stream=%s",
            agent,
            priority,
            ticket.id,
            engine_request.stream,
        )
        return _ExchangeResponse(exchange, stream=engine_request.stream)

    def _repairable_tools(self, engine_request: EngineRequest) -> dict[str, Any] | None:
        """Declared tools for tool-call repair: auto mode only (forced calls are constrained)."""
        if not self.config.tool_repair or "tools" not in engine_request.body:
            return None
        tools = engine_request.request.tools or ()
        return {tool.name: tool.input_schema for tool in tools if tool.input_schema is not None}

    async def _fit(
        self, agent: str, priority: int, engine_request: EngineRequest
    ) -> tuple[EngineRequest, Fingerprint, int | None]:
        """Apply the agent's compactions, check the prompt fits a slot, and cap max_tokens.

        Returns the request to send, its fingerprint, and its prompt size in tokens (None when the
        context size is unknown or checking is off). Raises PromptTooLongError when the prompt
        cannot fit even after compaction; such a request never reaches llama-server.
        """
        config = self.config
        body = engine_request.body
        if config.compaction:
            body, fingerprint, _ = self.compactor.store.rewrite(agent, body, self.fingerprinter)
        else:
            fingerprint = self.fingerprinter.fingerprint(body)
        ctx = config.ctx_per_slot
        if ctx is None or not config.check_prompt_length:
            return attrs.evolve(engine_request, body=body), fingerprint, None
        tokens = await self.client.count_prompt_tokens(body)
        requested = int(body.get("max_tokens") or 1)
        limit = ctx - min(requested, config.output_reserve)
        if tokens > limit and config.compaction:
            # Too long as it stands: compact now, at the request's own priority, and count again.
            done = await self.compactor.compact(
                agent, body, tokens, priority=priority, background=False
            )
            if done is not None:
                body, fingerprint, _ = self.compactor.store.rewrite(
                    agent, engine_request.body, self.fingerprinter
                )
                tokens = await self.client.count_prompt_tokens(body)
        if tokens > limit:
            raise PromptTooLongError(tokens, limit)
        threshold = config.compaction_threshold
        if config.compaction and threshold is not None and tokens > threshold:
            self.compactor.schedule(agent, body, tokens)
        # Claude Code asks for 32000 output tokens; the slot holds only what is left of its context.
        body = {**body, "max_tokens": max(1, min(requested, ctx - tokens))}
        return attrs.evolve(engine_request, body=body), fingerprint, tokens

    async def count_tokens(self, request: Request) -> Response:
        self.check_auth(request)
        body = await self.read_json(request)
        # count_tokens takes no max_tokens; the translator wants one; it does not touch the prompt.
        body.setdefault("max_tokens", 1)
        engine_request = self.translator.translate(body)
        count = await self.client.count_prompt_tokens(engine_request.body)
        return JSONResponse({"input_tokens": count})

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        entry = {
            "type": "model",
            "id": self.config.model_name,
            "display_name": self.config.model_name,
            "created_at": "2025-01-01T00:00:00Z",
        }
        return JSONResponse(
            {"data": [entry], "has_more": False, "first_id": entry["id"], "last_id": entry["id"]}
        )

    async def health(self, request: Request) -> Response:
        engine_ok = await self.client.health()
        table = self.gateway.table()
        return JSONResponse(
            {
                "status": "ok" if engine_ok else "engine_unavailable",
                "engine": engine_ok,
                "slots": self.config.n_slots,
                "queued": len(table["queue"]),
            },
            status_code=200 if engine_ok else 503,
        )

    async def slots(self, request: Request) -> Response:
        self.check_auth(request)
        table = self.gateway.table()
        table["compactions"] = self.compactor.store.table()
        table["parked"] = [] if self._parking_off else self.parking.table()
        return JSONResponse(table)


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _guard(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Turn every failure into an Anthropic-shaped error; nothing escapes as a bare 500 page."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except AgentKVError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unexpected error in %s", request.url.path)
            return error_response(AgentKVError("internal error in agentkv; see the server log"))

    return guarded


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFoundError(f"no route for {request.method} {request.url.path}"))
    if exc.status_code == 405:
        err = InvalidRequestError(f"method {request.method} is not allowed on {request.url.path}")
        return JSONResponse(err.to_anthropic(), status_code=405)
    return JSONResponse(
        {"type": "error", "error": {"type": "api_error", "message": str(exc.detail)}},
        status_code=exc.status_code,
    )


def create_app(
    client: LlamaSlotClient,
    config: ServerConfig | None = None,
    *,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> Starlette:
    """Build the ASGI app around an engine client. The caller owns the engine process."""
    config = config or ServerConfig()
    gateway = Gateway(
        n_slots=config.n_slots,
        aging=config.aging,
        max_queue=config.max_queue,
        lease_ttl=config.lease_ttl,
        tie_window=config.tie_window,
        preempt_from=config.preempt_from,
    )
    fingerprinter = PrefixFingerprinter()
    compactor = Compactor(
        gateway=gateway,
        client=client,
        fingerprinter=fingerprinter,
        keep_recent=config.compact_keep_messages,
    )
    state = AgentKV(
        config=config,
        client=client,
        gateway=gateway,
        fingerprinter=fingerprinter,
        compactor=compactor,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gateway.run_watchdog, config.watchdog_interval)
            compactor.attach(tg)
            try:
                yield
            finally:
                compactor.attach(None)
                tg.cancel_scope.cancel()
                if on_shutdown is not None:
                    with anyio.CancelScope(shield=True):
                        await on_shutdown()

    routes = [
        Route("/v1/messages", _guard(state.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guard(state.count_tokens), methods=["POST"]),
        Route("/v1/models", _guard(state.models), methods=["GET"]),
        Route("/health", _guard(state.health), methods=["GET"]),
        Route("/agentkv/slots", _guard(state.slots), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error}
    )
    app.state.agentkv = state
    return app
