"""Connection limits the HTTP server itself lacks: a deadline for the request body.

uvicorn bounds header size (``h11_max_incomplete_event_size``), idle keep-alive connections
(``timeout_keep_alive``) and the number of connections (``limit_concurrency``), but not how long a
client may take to send its body: a client dribbling one byte a second holds its connection, and
a task, forever. :class:`BodyTimeoutMiddleware` gives every request ``timeout`` seconds, from the
moment its headers are in, to deliver its whole body; a late one is cut with 408 and the
connection is closed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from agentkv.exceptions import AgentKVError

__all__ = ["BodyTimeoutMiddleware", "RequestTimeoutError"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestTimeoutError(AgentKVError):
    """The client did not send its request body in time."""

    status = 408
    error_type = "invalid_request_error"


class BodyTimeoutMiddleware:
    """ASGI middleware: a request's body must arrive within ``timeout`` seconds, else 408.

    The deadline covers reading the body only; waiting for a client's disconnect afterwards (a
    long streamed reply) is not limited. The app sees :class:`RequestTimeoutError` raised from
    ``receive`` and answers it like any agentkv error; if the app lets it through, the middleware
    sends the 408 itself (when no response has started).
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
            await _send_error(send, exc)


async def _send_error(send: Send, exc: AgentKVError) -> None:
    body = json.dumps(exc.to_anthropic()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
