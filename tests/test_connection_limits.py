"""Connection limits and engine-state answers: the body deadline (408), 529 with retry-after while
the engine restarts, /health's three states, and the CLI's connection settings."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentkv.runtime.engine import free_port
from agentkv.runtime.status import EngineStatus
from agentkv_server import cli
from agentkv_server.limits import (
    BodyTimeoutMiddleware,
    RequestTimeoutError,
    h11_with_header_timeout,
)
from tests.fakes import FakeLlama, served

pytestmark = pytest.mark.anyio

BODY = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with served(FakeLlama()) as client:
        yield client


# -- the body deadline, in-process ----------------------------------------------------------------


class Exchange:
    """Drives an ASGI app by hand: a body sent in the given pieces, then silence."""

    def __init__(self, pieces: list[bytes], *, finish: bool) -> None:
        self.pieces = list(pieces)
        self.finish = finish
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.pieces:
            last = not self.pieces[1:] and self.finish
            return {"type": "http.request", "body": self.pieces.pop(0), "more_body": not last}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


def scope(path: str = "/v1/messages", length: int = 100) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("127.0.0.1", 8788),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
            (b"host", b"127.0.0.1:8788"),
        ],
    }


async def test_dribbling_body_is_cut_with_408(http: httpx.AsyncClient) -> None:
    """A body that stops arriving gets 408 in the Anthropic shape, and the connection closes."""
    app = BodyTimeoutMiddleware(http.app, timeout=0.2)  # type: ignore[attr-defined]
    exchange = Exchange([b'{"model": '], finish=False)
    started = time.monotonic()
    with anyio.fail_after(5):
        await app(scope(), exchange.receive, exchange.send)
    assert 0.2 <= time.monotonic() - started < 2
    assert exchange.status == 408
    assert exchange.headers[b"connection"] == b"close"
    error = exchange.json
    assert error["type"] == "error"
    assert "did not arrive within 0.2 s" in error["error"]["message"]


async def test_whole_body_in_time_is_served(http: httpx.AsyncClient) -> None:
    """A body that arrives in pieces within the deadline is served normally."""
    app = BodyTimeoutMiddleware(http.app, timeout=5)  # type: ignore[attr-defined]
    data = json.dumps(BODY).encode()
    exchange = Exchange([data[:10], data[10:]], finish=True)
    with anyio.fail_after(5):
        await app(scope(length=len(data)), exchange.receive, exchange.send)
    assert exchange.status == 200
    assert exchange.json["type"] == "message"


async def test_deadline_covers_the_body_only() -> None:
    """After the body, waiting on receive() (for a disconnect) is not limited."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        with anyio.move_on_after(0.4):
            await receive()  # a long streamed reply waits here for the client to leave
        seen.append("not cut")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    exchange = Exchange([b"{}"], finish=True)
    with anyio.fail_after(5):
        await BodyTimeoutMiddleware(app, timeout=0.1)(scope(), exchange.receive, exchange.send)
    assert seen == ["not cut"]
    assert exchange.status == 200


async def test_app_that_lets_the_timeout_through_still_answers_408() -> None:
    """An app without agentkv's error handlers: the middleware answers the 408 itself."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass

    exchange = Exchange([b"{"], finish=False)
    with anyio.fail_after(5):
        await BodyTimeoutMiddleware(app, timeout=0.1)(scope(), exchange.receive, exchange.send)
    assert exchange.status == 408
    assert exchange.json["error"]["type"] == RequestTimeoutError.error_type


async def test_zero_timeout_and_other_scopes_pass_through() -> None:
    """timeout 0 and non-HTTP scopes are not wrapped."""
    calls: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(receive)

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        pass

    await BodyTimeoutMiddleware(app, timeout=0)(scope(), receive, send)
    await BodyTimeoutMiddleware(app, timeout=1)({"type": "lifespan"}, receive, send)
    assert calls == [receive, receive]


# -- the body deadline over a real socket --------------------------------------------------------


async def test_slow_client_on_a_real_socket_gets_408_and_is_disconnected() -> None:
    """Through uvicorn: a client that sends its headers and a part of the body, then stalls, gets
    408 and the server closes the connection."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(
        BodyTimeoutMiddleware(app, timeout=0.3),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)

    def slow_client() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"a": '
            )
            received = b""
            while chunk := sock.recv(4096):  # ends when the server closes the connection
                received += chunk
            return received

    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes readiness as a flag
                await anyio.sleep(0.02)
            reply = await anyio.to_thread.run_sync(slow_client)
        server.should_exit = True
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["message"].startswith("the request body did not arrive")


# -- the header deadline over a real socket ------------------------------------------------------


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


async def with_server(header_timeout: float, talk: Any) -> Any:
    """Run ``talk(port)`` in a thread against uvicorn with the header deadline."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            _ok,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            http=h11_with_header_timeout(header_timeout),
            timeout_keep_alive=30,
        )
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(20):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes readiness as a flag
                await anyio.sleep(0.02)
            result = await anyio.to_thread.run_sync(talk, port)
        server.should_exit = True
    return result


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    started = time.monotonic()
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received, time.monotonic() - started


async def test_silent_connection_is_closed_after_the_header_deadline() -> None:
    """A connection that sends nothing is closed once the header deadline passes."""

    def talk(port: int) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            return read_until_closed(sock)

    received, waited = await with_server(0.3, talk)
    assert received == b""
    assert 0.2 < waited < 5


async def test_dribbled_headers_are_cut_off() -> None:
    """Headers sent a few bytes at a time, never finished: closed at the deadline."""

    def talk(port: int) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            try:
                for piece in (b"POST / HTTP/1.1\r\n", b"host: x\r\n", b"x-slow: 1"):
                    sock.sendall(piece)
                    time.sleep(0.1)
            except OSError:  # pragma: no cover - closed early, also a pass
                pass
            received, _ = read_until_closed(sock)
            return received, time.monotonic() - started

    received, waited = await with_server(0.5, talk)
    assert received == b""
    assert 0.4 < waited < 5


async def test_keep_alive_idle_time_does_not_count_as_header_time() -> None:
    """Two whole requests on one keep-alive connection, idle longer than the header deadline
    between them: both are answered."""

    def talk(port: int) -> list[bytes]:
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
        replies = []
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for _ in range(2):
                sock.sendall(request)
                reply = b""
                while not reply.endswith(b"ok"):
                    reply += sock.recv(4096)
                replies.append(reply)
                time.sleep(0.6)
        return replies

    replies = await with_server(0.3, talk)
    assert [r.split(b"\r\n", 1)[0] for r in replies] == [b"HTTP/1.1 200 OK"] * 2


# -- engine states through the app ----------------------------------------------------------------


async def test_health_reports_ready_restarting_and_unavailable(http: httpx.AsyncClient) -> None:
    """/health: 200 ready; 503 engine_restarting with retry-after; 503 engine_unavailable."""
    status = EngineStatus()
    http.runtime.client.status = status  # type: ignore[attr-defined]
    r = await http.get("/health")
    assert (r.status_code, r.json()["status"], r.json()["engine"]) == (200, "ready", True)
    assert r.json()["engine_generation"] == 1
    status.set_state("restarting", "llama-server exited with signal 9 (SIGKILL)", retry_after=4.5)
    r = await http.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "engine_restarting"
    assert "SIGKILL" in r.json()["detail"]
    assert r.headers["retry-after"] == "5"
    status.set_state("unavailable", "failed 6 times")
    r = await http.get("/health")
    assert (r.status_code, r.json()["status"]) == (503, "engine_unavailable")
    assert "retry-after" not in r.headers
    status.new_generation()
    r = await http.get("/health")
    assert (r.status_code, r.json()["engine_generation"], r.json()["engine_restarts"]) == (
        200,
        2,
        1,
    )


async def test_requests_during_a_restart_get_529_with_retry_after(
    http: httpx.AsyncClient,
) -> None:
    """Messages, count_tokens and models during a restart: 529 overloaded_error with
    retry-after; served again once the engine is back."""
    status = EngineStatus()
    http.runtime.client.status = status  # type: ignore[attr-defined]
    status.set_state("restarting", "llama-server exited", retry_after=3)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = await http.post(path, json=BODY)
        assert r.status_code == 529, path
        assert r.json()["error"]["type"] == "overloaded_error"
        assert r.headers["retry-after"] == "3"
    r = await http.get("/v1/models")
    assert (r.status_code, r.headers["retry-after"]) == (529, "3")
    status.new_generation()
    r = await http.post("/v1/messages", json=BODY)
    assert r.status_code == 200
    assert (await http.get("/v1/models")).status_code == 200


async def test_health_without_a_supervisor_probes_the_engine(http: httpx.AsyncClient) -> None:
    """Without a supervisor (--upstream), /health probes the engine and has no generation."""
    r = await http.get("/health")
    assert r.json()["status"] == "ready"
    assert "engine_generation" not in r.json()


# -- the CLI's settings ---------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def test_connection_settings_are_deliberate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep-alive, connection limit (bounded by the open-file limit), header size, shutdown."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, 4096))
    settings = cli._connection_settings(parse())
    protocol = settings.pop("http")
    assert issubclass(protocol, H11Protocol)
    assert protocol.header_timeout == 10.0
    assert settings == {
        "timeout_keep_alive": 15,
        "limit_concurrency": 128,
        "h11_max_incomplete_event_size": 64 * 1024,
        "timeout_graceful_shutdown": 10,
    }
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (65536, 65536))
    assert cli._connection_settings(parse())["limit_concurrency"] == 512
    given = cli._connection_settings(parse("--max-connections", "40", "--keep-alive-timeout", "3"))
    assert (given["limit_concurrency"], given["timeout_keep_alive"]) == (40, 3)
    # Every setting is a real uvicorn option.
    uvicorn.Config(lambda: None, http=protocol, **settings)


def test_engine_options_parse() -> None:
    """--kv-budget takes units; the supervision and templating options have their defaults."""
    args = parse("--kv-budget", "6GiB")
    assert args.kv_budget == 6 << 30
    assert (args.max_restarts, args.restart_window, args.templating_limit) == (5, 300.0, 4)
    assert args.body_timeout == 30.0
    with pytest.raises(SystemExit):
        parse("--kv-budget", "lots")


def test_printed_claude_code_lines_never_show_the_api_key() -> None:
    """With a key configured the lines read it from $AGENTKV_API_KEY; the key itself is absent."""
    lines = cli.claude_code_env(
        "http://127.0.0.1:8788", "s3cret-key", ctx_per_slot=32768, timeout=600
    )
    assert "s3cret-key" not in lines
    assert 'export ANTHROPIC_API_KEY="$AGENTKV_API_KEY"' in lines
    open_lines = cli.claude_code_env("http://x", None, ctx_per_slot=None, timeout=600)
    assert "export ANTHROPIC_API_KEY=agentkv" in open_lines


async def test_count_tokens_of_a_client_that_leaves_is_cancelled() -> None:
    """A count_tokens caller that disconnects: its templating call is cancelled, not finished."""
    entered = anyio.Event()
    cancelled = anyio.Event()

    class Hanging(FakeLlama):
        """Templating never finishes."""

        async def handle(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/apply-template":
                entered.set()
                try:
                    await anyio.sleep_forever()
                finally:
                    cancelled.set()
            return await super().handle(request)

    fake = Hanging()
    data = json.dumps(BODY).encode()
    gone = anyio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with served(fake) as http:
        app = http.app  # type: ignore[attr-defined]
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(app, scope("/v1/messages/count_tokens", len(data)), receive, send)
                await entered.wait()
                gone.set()
                await cancelled.wait()
    assert sent[0]["status"] == 499
