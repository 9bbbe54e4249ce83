"""A TCP proxy on loopback that drops requests arriving on reused connections (seeded).

It stands for a link that loses a connection between two requests: llama-server closing a
connection after a stream although it advertised keep-alive, a NAT or a load balancer timing one
out. Each client connection gets its own upstream connection, and bytes flow through unchanged,
except that a request arriving on a connection that already carried one is, with probability
``rate``, dropped: both connections are closed before a byte of it reaches upstream. The client
then sees what httpx reports for a pooled connection the server had closed
(``RemoteProtocolError: Server disconnected without sending a response``).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.abc
import attrs

_HEADER_END = b"\r\n\r\n"
_CLOSED = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream)


@attrs.define
class DropReused:
    """``async with DropReused.running(host, port, seed=1) as proxy``: ``proxy.url`` forwards
    to ``host:port``."""

    upstream_host: str
    upstream_port: int
    seed: int = 0
    rate: float = 0.5
    port: int = 0
    #: Requests seen, those that arrived on a reused connection, and those dropped.
    requests: int = 0
    reused: int = 0
    dropped: int = 0
    connections: int = 0
    _random: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._random = random.Random(self.seed)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    @asynccontextmanager
    async def running(
        cls, upstream_host: str, upstream_port: int, *, seed: int = 0, rate: float = 0.5
    ) -> AsyncIterator[DropReused]:
        proxy = cls(upstream_host, upstream_port, seed=seed, rate=rate)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        proxy.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, proxy._connection)
            try:
                yield proxy
            finally:
                tg.cancel_scope.cancel()

    async def _connection(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        try:
            upstream = await anyio.connect_tcp(self.upstream_host, self.upstream_port)
        except OSError:
            await client.aclose()
            return
        async with client, upstream, anyio.create_task_group() as tg:

            async def replies() -> None:
                with suppress(*_CLOSED):
                    async for data in upstream:
                        await client.send(data)
                tg.cancel_scope.cancel()  # upstream closed: so does the client's connection

            tg.start_soon(replies)
            with suppress(*_CLOSED):
                await self._requests(client, upstream)
            tg.cancel_scope.cancel()

    async def _requests(
        self, client: anyio.abc.SocketStream, upstream: anyio.abc.SocketStream
    ) -> None:
        """Forward whole requests (headers, then a Content-Length body); drop some on reuse."""
        buffer = b""
        served = 0
        while True:
            while _HEADER_END not in buffer:
                buffer += await client.receive()
            head, _, buffer = buffer.partition(_HEADER_END)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(buffer) < length:
                buffer += await client.receive()
            body, buffer = buffer[:length], buffer[length:]
            self.requests += 1
            if served:
                self.reused += 1
                if self._random.random() < self.rate:
                    self.dropped += 1
                    return  # closes both connections before upstream saw the request
            served += 1
            await upstream.send(head + _HEADER_END + body)
