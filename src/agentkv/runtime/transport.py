"""EngineTransport: the one place agentkv talks HTTP to an engine.

Every request to the engine goes through here: llama-server's
:class:`~agentkv.runtime.client.LlamaSlotClient` and the OpenAI-compatible engines'
:class:`~agentkv.runtime.adapters.OpenAIEngineClient` are each a :class:`LinkedEngine`, which holds
one. So every upstream failure is mapped once, at this boundary, onto the agentkv exception tree:
unreachable → :class:`EngineUnavailableError`, stalled → :class:`EngineTimeoutError`, error status
or unparseable body → :class:`EngineResponseError`. An error names the engine (``engine_name``).

No call meets a connection a stream used. llama-server advertises keep-alive after a streamed
reply but sometimes closes the socket right after the stream ends; a pooled connection then fails
the next request sent on it. So a chat completion (streamed or not) always has a connection of its
own, which it asks to be closed afterwards (also on an injected, pooling client). The calls that
are safe to repeat (templating, tokenizing, slot actions, the operator's reads) share one
kept-alive connection, idle at most :data:`KEEPALIVE_SECONDS` (llama-server closes its own after
5 s), which saves a connection's setup on the two calls before every reply; when that connection
turns out closed anyway, the call is sent once more on a new one (below).

Requests are retried only where a retry cannot repeat work or costs nothing:

- the connection was refused or could not be opened, or llama-server answered 503 because it is
  still loading the model: retried with backoff (``connect_retries``, ``retry_seconds``);
- the connection closed before any byte of the response arrived: sent once more, at once, on a
  new connection. That holds for every call, a chat completion included: llama-server had sent
  nothing, so the client has seen nothing of it;
- a call that is safe to repeat (health, metrics, slots, apply-template, tokenize, detokenize,
  slot save, restore and erase) whose reply broke while it was being read, or that got a 502 or
  504 from something between agentkv and the engine: once more as well.

Nothing is retried once a response body has started to reach the caller.

Low-level httpx errors are mapped by one table,
:data:`~agentkv.runtime.error_map.HTTPX_ERROR_MAP`, in one place (:mod:`agentkv.runtime.error_map`).
Streams are parsed by :mod:`agentkv.runtime.chunks`; readiness is :mod:`agentkv.runtime.health`'s.
When agentkv supervises the engine (``status``), a request made while it restarts fails at once
with :class:`EngineRestartingError` (529, ``retry-after``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypedDict, TypeVar, Unpack

import anyio
import attrs
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
    EngineStreamBrokenError,
    EngineUnavailableError,
)
from agentkv.runtime.chunks import ChunkStream
from agentkv.runtime.error_map import (
    GATEWAY_STATUSES,
    HTTPX_ERRORS,
    DroppedError,
    NotReadyError,
    map_httpx_error,
    parse_json,
    status_error,
)
from agentkv.runtime.health import probe, wait_until_ready
from agentkv.runtime.status import EngineStatus

if TYPE_CHECKING:
    from agentkv.runtime.seam import SlotsChanged
    from agentkv.snapshot import EngineRow

__all__ = [
    "CHAT_PATH",
    "KEEPALIVE_SECONDS",
    "LLAMA_SERVER",
    "EngineTransport",
    "LinkOptions",
    "LinkStats",
    "LinkedEngine",
    "in_name_of",
    "new_http_client",
]

log = logging.getLogger("agentkv.client")

T = TypeVar("T")

#: The engine the error map's messages name.
LLAMA_SERVER = "llama-server"
#: llama-server's (and every OpenAI-compatible engine's) chat completion path.
CHAT_PATH = "/v1/chat/completions"
# Opening a TCP connection to a local server never legitimately takes long; a slow connect means
# the host is wrong or the server is wedged, and the caller should hear about it quickly.
_CONNECT_TIMEOUT = 10.0


#: While an engine restart is under way, a mid-stream break waits this long for the supervisor to
#: notice, so that the caller hears "restarting" rather than "truncated".
_SETTLE_SECONDS = 1.0


#: How long the kept-alive connection may stay idle (each one open holds an HTTP thread of
#: llama-server's).
KEEPALIVE_SECONDS = 2.0


def new_http_client(
    timeout: httpx.Timeout | float = 600.0, *, keep_alive: bool = False
) -> httpx.AsyncClient:
    """The HTTP client for an engine: a new connection for every call, or (``keep_alive``) one
    kept-alive connection for the calls that never stream and are safe to send again (see the
    module docstring)."""
    if keep_alive:
        limits = httpx.Limits(max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_SECONDS)
    else:
        limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


@attrs.define
class LinkStats:
    """Counters of the engine link (for the operator and the tests)."""

    #: Requests sent to llama-server (each attempt counts).
    requests: int = 0
    #: Requests sent once more on a new connection after the first was dropped.
    resent: int = 0


def in_name_of(error: EngineError, engine_name: str) -> EngineError:
    """``error`` naming ``engine_name`` where the error map says llama-server."""
    if engine_name != LLAMA_SERVER and LLAMA_SERVER in error.message:
        error.message = error.message.replace(LLAMA_SERVER, engine_name)
        error.args = (error.message,)
    return error


class EngineTransport:
    """One engine's HTTP link: its connections, retries and error map.

    ``http`` may be injected (tests use ``httpx.MockTransport``); a client created here is closed by
    :meth:`aclose`. ``connect_retries`` and ``retry_seconds`` bound the safe retries (refused
    connection, 503 while loading); ``read_timeout`` is how long the engine may stay silent
    mid-request before :class:`EngineTimeoutError`. ``api_key`` is sent as ``Authorization:
    Bearer``. ``status`` is the supervisor's view of that engine: while it restarts, requests fail
    at once with :class:`EngineRestartingError`. ``engine_name`` is the engine in error messages.
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
        api_key: str | None = None,
        status: EngineStatus | None = None,
        engine_name: str = LLAMA_SERVER,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_name = engine_name
        self._owns_http = http is None
        self._timeout = httpx.Timeout(read_timeout, connect=_CONNECT_TIMEOUT)
        self._http = http if http is not None else new_http_client(self._timeout)
        #: The first try of a call that is safe to repeat: one kept-alive connection (an
        #: injected client is used as it is).
        self._kept = http if http is not None else new_http_client(self._timeout, keep_alive=True)
        self._connect_retries = max(0, connect_retries)
        self._retry_seconds = retry_seconds
        self._retry_backoff = retry_backoff
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._status = status
        #: :attr:`status` is this link's own, moved by :meth:`set_reachable` (no supervisor).
        self._own_status = False
        #: What the link has seen: requests sent, and those sent again after a drop.
        self.link = LinkStats()

    @property
    def status(self) -> EngineStatus | None:
        return self._status

    @status.setter
    def status(self, status: EngineStatus | None) -> None:
        """A supervisor's status, given after the link was made: the supervisor's to move."""
        self._status, self._own_status = status, False

    def _named(self, error: EngineError) -> EngineError:
        return in_name_of(error, self.engine_name)

    def note_resent(self) -> None:
        """A caller sent a call once more after its reply broke (counted in :attr:`link`)."""
        self.link.resent += 1

    @property
    def http(self) -> httpx.AsyncClient:
        """The client of the calls that open a connection each (the readiness probes)."""
        return self._http

    def set_reachable(self, reachable: bool, detail: str = "") -> bool:
        """Whether the engine answers, as a health watcher other than a supervisor finds it (a
        pool's probes): while it does not (``detail`` says why), calls fail at once instead of
        waiting on refused connections, and a stream that breaks first waits a moment for that
        verdict. The link keeps a status of its own for it from the first call on.

        An engine whose supervisor gave the status is the supervisor's to judge: False, and
        nothing changes.
        """
        if self._status is None:
            self._status, self._own_status = EngineStatus(), True
        if not self._own_status:
            return False
        self._status.set_state("ready" if reachable else "unavailable", "" if reachable else detail)
        return True

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()
            await self._kept.aclose()

    # -- requests -------------------------------------------------------------------------------

    async def request_json(
        self,
        method: str,
        path: str,
        what: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        safe: bool = True,
    ) -> Any:
        """One call with a JSON reply. ``safe``: the call may be repeated (everything but a chat
        completion), so a reply that breaks while it is read is asked for once more."""
        response = await self.send(method, path, what, json_body, params=params, safe=safe)
        return parse_json(response.text, what)

    @contextlib.asynccontextmanager
    async def streaming(self, response: httpx.Response, what: str) -> AsyncIterator[ChunkStream]:
        """The chunks of a streamed reply to ``what`` (a read that fails is this link's error);
        leaving the block (also by cancellation) closes the response, which stops the engine
        generating."""

        async def engine_error(exc: Exception | None) -> EngineError:
            return await self._engine_error(exc, what, started=True)

        try:
            yield ChunkStream(response, engine_error)
        finally:
            # Shielded: closing must happen even when the caller is being cancelled, or the
            # engine would keep generating into a connection nobody reads.
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def _engine_error(
        self, exc: Exception | None, what: str, *, started: bool
    ) -> EngineError:
        """The error for a failed request (``exc`` None: a stream that ended too early).

        While the supervisor restarts the engine, that is the error: the caller should retry.
        A broken stream waits a moment for the supervisor to notice a dead engine first.
        """
        if exc is None:
            error: EngineError = EngineStreamBrokenError(
                f"llama-server {what} stream ended before the completion finished (truncated)"
            )
        else:
            error = map_httpx_error(exc, what, self.base_url, started=started)
        error = self._named(error)
        status = self.status
        if status is not None and isinstance(error, EngineUnavailableError | EngineResponseError):
            if started and status.state == "ready":
                with anyio.move_on_after(_SETTLE_SECONDS):
                    await status.changed()
            restarting = status.error()
            if restarting is not None:
                return self._named(restarting)
        return error

    async def send(
        self,
        method: str,
        path: str,
        what: str,
        json_body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        stream: bool = False,
        safe: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request, retrying only the safe cases; a 2xx response or an agentkv error.

        With ``stream=True`` the returned response body is unread and the caller must close it;
        otherwise the body is read here (and, when ``safe``, asked for again if it broke).
        ``headers`` are sent besides the client's own (an adapter's per-request hints).
        """
        headers = {**(headers or {}), **self._headers}
        if stream:
            headers["connection"] = "close"  # a stream's connection is never used again
        dropped: DroppedError | None = None
        while True:
            retrying = AsyncRetrying(
                stop=stop_after_attempt(self._connect_retries + 1)
                | stop_after_delay(self._retry_seconds),
                wait=wait_exponential(multiplier=self._retry_backoff, max=2.0),
                retry=retry_if_exception_type(NotReadyError),
                sleep=anyio.sleep,
                reraise=True,
            )
            # A call sent once more after a drop goes on a new connection.
            http = self._kept if safe and not stream and dropped is None else self._http
            build = functools.partial(
                http.build_request,
                method,
                self.base_url + path,
                json=json_body,
                params=params,
                headers=headers,
                timeout=self._timeout,
            )
            try:
                return await retrying(self._attempt, http, build, what, stream=stream, safe=safe)
            except NotReadyError as exc:
                # Callers see the public type; the private subclass only steers the retries.
                raise EngineUnavailableError(exc.message) from exc.__cause__
            except DroppedError as exc:
                if dropped is not None:
                    raise EngineUnavailableError(
                        f"{exc.message} (also when sent again on a new connection)"
                    ) from exc.__cause__
                dropped = exc
                self.link.resent += 1
                log.info("%s; sending it once more on a new connection", exc.message)

    async def _attempt(
        self,
        http: httpx.AsyncClient,
        build: Callable[[], httpx.Request],
        what: str,
        *,
        stream: bool,
        safe: bool,
    ) -> httpx.Response:
        if self.status is not None and (refused := self.status.error()) is not None:
            raise self._named(refused)
        self.link.requests += 1
        try:
            # Always sent as a stream: what failed before the reply's first byte (safe to send
            # again) is then told apart from what failed while reading it.
            response = await http.send(build(), stream=True)
        except HTTPX_ERRORS as exc:
            raise await self._engine_error(exc, what, started=False) from exc
        if response.is_success and stream:
            return response
        try:
            await response.aread()
        except HTTPX_ERRORS as exc:
            raise await self._engine_error(exc, what, started=not safe) from exc
        finally:
            await response.aclose()
        if response.is_success:
            return response
        error = self._named(status_error(response, what))
        if safe and response.status_code in GATEWAY_STATUSES:
            raise DroppedError(error.message) from error
        raise error


class LinkOptions(TypedDict, total=False):
    """The :class:`EngineTransport` arguments an engine client takes and passes on (see there)."""

    http: httpx.AsyncClient | None
    connect_retries: int
    retry_seconds: float
    read_timeout: float
    retry_backoff: float
    api_key: str | None
    status: EngineStatus | None


class LinkedEngine:
    """One engine on one :class:`EngineTransport`, which it alone holds (as an
    ``httpx.AsyncClient`` holds its transport): the common base of the engine clients. It
    answers what the :class:`~agentkv.runtime.seam.Engine` asks of the link (readiness, health,
    the supervisor's status, closing) and of one engine; a subclass adds the engine's own calls.

    ``link`` are the :class:`EngineTransport`'s arguments. ``templating_limit`` bounds how many
    templating and tokenizing calls a subclass sends at once (under :attr:`_templating`); the
    others wait their turn, and a caller cancelled while waiting never sends its call.
    """

    #: The engine, in words (the banner, log lines, error messages).
    engine_name: ClassVar[str]

    def __init__(
        self, base_url: str, *, templating_limit: int = 4, **link: Unpack[LinkOptions]
    ) -> None:
        self._transport = EngineTransport(base_url, engine_name=self.engine_name, **link)
        self._templating = anyio.CapacityLimiter(max(1, templating_limit))

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    @property
    def link(self) -> LinkStats:
        """What the engine link has seen: requests sent, and those sent again after a drop."""
        return self._transport.link

    @property
    def status(self) -> EngineStatus | None:
        """The supervisor's view of the engine (None: not supervised by this process)."""
        return self._transport.status

    @status.setter
    def status(self, status: EngineStatus | None) -> None:
        self._transport.status = status

    @property
    def restarts(self) -> int:
        """The engine's restarts by its supervisor so far (none when not supervised here)."""
        return self.status.restarts if self.status is not None else 0

    async def health(self) -> bool:
        """True when the engine is up and has loaded its model (one probe, no retries)."""
        state, _ = await probe(self._transport.http, self.base_url)
        return state == "ready"

    async def engine_state(self) -> tuple[str, str]:
        """What ``/health`` reports: ``("ready" | "engine_restarting" | "engine_unavailable",
        detail)``, from the supervisor's status where there is one, else from one probe."""
        if self.status is not None and self.status.state != "ready":
            return f"engine_{self.status.state}", self.status.detail
        state, detail = await probe(self._transport.http, self.base_url)
        return ("ready", detail) if state == "ready" else ("engine_unavailable", detail)

    async def wait_ready(
        self,
        timeout: float,  # noqa: ASYNC109 - part of the public contract
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Poll ``/health`` until the model is loaded; :class:`EngineUnavailableError` after
        ``timeout`` seconds. ``on_progress`` hears each change of state in words."""
        http = self._transport.http
        await wait_until_ready(http, self.base_url, timeout=timeout, on_progress=on_progress)

    def set_reachable(self, reachable: bool, detail: str = "") -> bool:
        """Whether the engine answers, as a pool's probes find it: see
        :meth:`EngineTransport.set_reachable`."""
        return self._transport.set_reachable(reachable, detail)

    def _expect(self, data: Any, kind: type[T], what: str, field: str | None = None) -> T:
        """``data`` (or its ``field``) when it is a ``kind``; else the engine's reply to ``what``
        is malformed (:class:`EngineResponseError`)."""
        value = data if field is None else data.get(field) if isinstance(data, Mapping) else None
        if not isinstance(value, kind):
            raise EngineResponseError(f"{self.engine_name} {what} returned {data!r:.200}")
        return value

    def engines(self) -> tuple[EngineRow, ...] | None:
        """One engine: no rows (a pool has one per engine)."""
        return None

    async def watch(self, on_change: SlotsChanged | None = None) -> None:
        """One engine: nothing to follow (its supervisor follows its restarts)."""

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        await self._transport.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
