"""Deadlines uvicorn lacks: for request headers (:func:`h11_with_header_timeout`) and bodies
(:class:`BodyTimeoutMiddleware`).

uvicorn bounds header size, idle keep-alive connections and the number of connections, but not
how long a client may take to send its request: one dribbling a byte a second holds its connection
(and, once its headers are in, a task) forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentkv.exceptions import AgentKVError

if TYPE_CHECKING:  # uvicorn's protocols are asyncio protocols; only their types are named here
    import asyncio

__all__ = ["BodyTimeoutMiddleware", "RequestTimeoutError", "h11_with_header_timeout"]


class RequestTimeoutError(AgentKVError):
    """The client did not send its request body in time."""

    status = 408
    error_type = "invalid_request_error"


class BodyTimeoutMiddleware:
    """ASGI middleware: a request's body must arrive within ``timeout`` seconds of its headers,
    else 408 and the connection is closed.

    Only reading the body is limited, not waiting for a disconnect afterwards. The app sees
    :class:`RequestTimeoutError` raised from ``receive`` and answers it like any agentkv error; if
    it lets it through, the middleware sends the 408 itself (when no response has started).
    """

    def __init__(self, app: ASGIApp, *, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout <= 0:
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.timeout
        body_done = False  # the whole body is in (or the client left)
        expired = False
        response_started = False

        async def timed_receive() -> Message:
            nonlocal body_done, expired
            if body_done or expired:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message
            expired = True
            raise RequestTimeoutError(f"the request body did not arrive within {self.timeout:g} s")

        async def tracked_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                if not body_done:
                    # The rest of the body will not be read: the connection cannot be reused.
                    message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except RequestTimeoutError as exc:
            if response_started:
                raise
            answer = JSONResponse(
                exc.to_anthropic(), status_code=exc.status, headers={"connection": "close"}
            )
            await answer(scope, receive, send)


class _HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all
    come within the deadline (counted from the connection, or from the first byte of a keep-alive
    connection's next request)."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def _in_request(self) -> bool:
        """Headers of the current request are in (a request/response cycle is running)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None and self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive in time")
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that sends nothing counts too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._disarm()
        else:
            self._arm()  # part of a (next) request's headers: they must all come in time

    def on_response_complete(self) -> None:
        # Idle time between requests is the keep-alive timeout's; the deadline starts with the
        # next request's first byte.
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def h11_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``seconds`` deadline for request headers (for
    ``uvicorn.Config(http=...)``); 0: no deadline."""
    return type(
        "HeaderDeadlineH11Protocol", (_HeaderDeadlineH11Protocol,), {"header_timeout": seconds}
    )
