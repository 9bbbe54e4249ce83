"""LlamaSlotClient: the one place agentkv talks HTTP to llama-server.

Every request to the engine goes through here, so every upstream failure is mapped once, at this
boundary, onto the agentkv exception tree: unreachable → :class:`EngineUnavailableError`, stalled →
:class:`EngineTimeoutError`, error status or unparseable body → :class:`EngineResponseError`.

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

Low-level httpx errors are mapped by one table, :data:`HTTPX_ERROR_MAP`, in one place
(:mod:`agentkv.runtime.error_map`). Streams are parsed by
:mod:`agentkv.runtime.chunks`; readiness is :mod:`agentkv.runtime.health`'s. When agentkv
supervises the engine (``status``), a request made while it restarts fails at once with
:class:`EngineRestartingError` (529, ``retry-after``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

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
from agentkv.prompts import PromptMemo, PromptStats, marker_candidates, template_key
from agentkv.runtime.chunks import ChunkStream
from agentkv.runtime.error_map import (
    GATEWAY_STATUSES,
    HTTPX_ERROR_MAP,
    HTTPX_ERRORS,
    DroppedError,
    NotReadyError,
    map_httpx_error,
    parse_json,
    status_error,
)
from agentkv.runtime.health import probe, wait_until_ready
from agentkv.runtime.seam import SlotsChanged
from agentkv.runtime.status import EngineStatus
from agentkv.snapshot import EngineRow

if TYPE_CHECKING:
    from agentkv.runtime.hints import EngineHints

__all__ = [
    "CHAT_PATH",
    "HTTPX_ERROR_MAP",
    "LinkStats",
    "LlamaSlotClient",
    "map_httpx_error",
    "new_http_client",
    "probe",
    "wait_until_ready",
]

log = logging.getLogger("agentkv.client")

#: llama-server's (and every OpenAI-compatible engine's) chat completion path.
CHAT_PATH = "/v1/chat/completions"
# Opening a TCP connection to a local server never legitimately takes long; a slow connect means
# the host is wrong or the server is wedged, and the caller should hear about it quickly.
_CONNECT_TIMEOUT = 10.0


#: While an engine restart is under way, a mid-stream break waits this long for the supervisor to
#: notice, so that the caller hears "restarting" rather than "truncated".
_SETTLE_SECONDS = 1.0


#: How many prompts tokenized in pieces are checked against the engine's whole tokenizing.
SPLIT_CHECKS = 3
#: At most this many strings are asked about at once, and this many remembered in all.
_LEARN_AT_ONCE = 16
_MARKERS_MAX = 512

#: How long the connection of the calls that are safe to repeat may stay idle before it is
#: closed (llama-server closes an idle one after 5 s; each one open holds one of its HTTP threads).
KEEPALIVE_SECONDS = 2.0


def new_http_client(
    timeout: httpx.Timeout | float = 600.0, *, keep_alive: bool = False
) -> httpx.AsyncClient:
    """The HTTP client for llama-server: by default a new connection for every call.

    llama-server sometimes closes a connection right after a streamed reply although it said
    keep-alive; a pooled connection is then dead when the next call takes it. ``keep_alive``:
    one idle connection is kept, at most :data:`KEEPALIVE_SECONDS`, for calls that never stream
    and are safe to send again.
    """
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


class LlamaSlotClient:
    """Async client for llama-server that pins chat requests to a slot and maps every failure.

    ``http`` may be injected (tests use ``httpx.MockTransport``); a client created here is closed by
    :meth:`aclose`. ``connect_retries`` and ``retry_seconds`` bound the safe retries (refused
    connection, 503 while loading); ``read_timeout`` is how long llama-server may stay silent
    mid-request before :class:`EngineTimeoutError`.

    ``api_key`` is sent as ``Authorization: Bearer`` (the key agentkv gave the llama-server it
    launched). ``status`` is the supervisor's view of that engine: while it restarts, requests fail
    at once with :class:`EngineRestartingError`. ``templating_limit`` bounds how many
    ``/apply-template`` and ``/tokenize`` calls run at once; the others wait their turn, and a
    caller cancelled while waiting never sends its call.
    """

    #: The engine has slots agentkv pins requests to, and saves and restores their KV cache as
    #: files (the prefix store). An engine that places requests itself
    #: (:mod:`agentkv.runtime.adapters`) has neither.
    slot_files: ClassVar[bool] = True
    #: The engine, in words (the banner, log lines).
    engine_name: ClassVar[str] = "llama-server"

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
        templating_limit: int = 4,
    ) -> None:
        self.base_url = base_url.rstrip("/")
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
        #: The supervisor's view of the engine (None: not supervised by this process).
        self.status = status
        #: :attr:`status` is this client's own, moved by :meth:`set_reachable` (no supervisor).
        self._own_status = False
        self._templating = anyio.CapacityLimiter(max(1, templating_limit))
        #: What the engine link has seen: requests sent, and those sent again after a drop.
        self.link = LinkStats()
        self._vision: bool | None = None
        #: The engine's templating and tokenizing answers, for the same question asked again.
        self.memo = PromptMemo()
        #: Where the prompt answers came from: kept, in pieces, or asked of the engine.
        self.prompt_stats = PromptStats()
        #: Special tokens the engine confirmed (text → id), and strings it did not.
        self._markers: dict[str, int] = {}
        self._not_markers: set[str] = set()
        #: Prompts tokenized in pieces and found right so far; None: pieces gave a wrong answer.
        self._split_checks: int | None = 0

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

    async def chat(
        self,
        body: Mapping[str, Any],
        *,
        slot: int | None,
        hints: EngineHints | None = None,
    ) -> dict[str, Any]:
        """Non-streaming chat completion on ``slot`` (None: any idle slot); the JSON reply with
        ``timings``. ``hints`` are for engines that place requests themselves; llama-server is
        placed by agentkv and needs none."""
        payload = self._chat_body(body, slot, stream=False)
        data = await self._request_json(
            "POST", CHAT_PATH, "chat completion", json_body=payload, safe=False
        )
        if not isinstance(data, dict):
            raise EngineResponseError(f"llama-server chat completion returned {data!r:.200}")
        return data

    @contextlib.asynccontextmanager
    async def stream(
        self,
        body: Mapping[str, Any],
        *,
        slot: int | None,
        hints: EngineHints | None = None,
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Streaming chat completion on ``slot``; yields an iterator of parsed chunk dicts
        (``hints``: as for :meth:`chat`).

        Leaving the ``async with`` block (also by cancellation) closes the upstream response, which
        makes llama-server stop generating and free the slot.
        """
        payload = self._chat_body(body, slot, stream=True)
        response = await self._send("POST", CHAT_PATH, "chat completion", payload, stream=True)
        try:
            yield self._chunks(response, "chat completion")
        finally:
            # Shielded: closing must happen even when the caller is being cancelled, or the
            # engine would keep generating into a connection nobody reads.
            with anyio.CancelScope(shield=True):
                await response.aclose()

    # -- prompt accounting --------------------------------------------------------------------

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``content``; special-token text (``<|im_start|>``) is parsed as such
        unless ``parse_special`` is False."""
        payload = {"content": content, "add_special": add_special, "parse_special": parse_special}
        async with self._templating:
            data = await self._request_json("POST", "/tokenize", "tokenize", json_body=payload)
        tokens = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(tokens, list):
            raise EngineResponseError(f"llama-server tokenize returned {data!r:.200}")
        # With with_pieces the entries are objects; we never ask for that, so ints are expected.
        return [int(t["id"]) if isinstance(t, Mapping) else int(t) for t in tokens]

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt text llama-server's chat template makes of a chat ``body``."""
        async with self._templating:
            data = await self._request_json(
                "POST", "/apply-template", "apply-template", json_body=dict(body)
            )
        prompt = data.get("prompt") if isinstance(data, Mapping) else None
        if not isinstance(prompt, str):
            raise EngineResponseError(f"llama-server apply-template returned {data!r:.200}")
        return prompt

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt tokens of a chat ``body``, exactly as llama-server computes them; an answer
        the engine gave before comes from :attr:`memo` (:mod:`agentkv.prompts`)."""
        memo, stats = self.memo, self.prompt_stats
        key = template_key(body, time.strftime("%Y-%m-%d"))  # strftime_now: the local day
        prompt = memo.template(key)
        if prompt is None:
            prompt = await self.apply_template(body)
            memo.keep_template(key, prompt)
            stats.templates_asked += 1
        else:
            stats.templates_kept += 1
        tokens = memo.tokens(prompt)
        if tokens is None:
            tokens = await self._tokenize_prompt(prompt)
            memo.keep_tokens(prompt, tokens)
        else:
            stats.tokens_kept += 1
        return tokens

    async def _tokenize_prompt(self, prompt: str) -> list[int]:
        """A templated prompt's tokens; when it begins like a prompt tokenized before, only its
        rest from a special token on is sent (:meth:`PromptMemo.split`)."""
        # llama-server tokenizes the templated chat prompt with add_special=True and
        # parse_special=True; the chat template already wrote any BOS the model wants.
        found = self.memo.nearest(prompt) if self._split_checks is not None else None
        split = None
        if found is not None:
            base, shared = found
            await self._learn_markers(self.memo.window(base, shared))
            split = self.memo.split(prompt, base, shared, self._markers)
        if split is None:
            self.prompt_stats.tokens_whole += 1
            return await self.tokenize(prompt, add_special=True)
        tokens = split.head + await self.tokenize(split.text)
        if self._split_checks is not None and self._split_checks < SPLIT_CHECKS:
            # The first answers made this way are checked against the engine's whole answer.
            whole = await self.tokenize(prompt, add_special=True)
            if whole != tokens:
                log.warning(
                    "%s tokenizes a prompt differently from its pieces; prompts are tokenized "
                    "whole from now on",
                    self.engine_name,
                )
                self._split_checks = None
                self.prompt_stats.tokens_whole += 1
                return whole
            self._split_checks += 1
        self.prompt_stats.tokens_pieces += 1
        return tokens

    async def _learn_markers(self, text: str) -> None:
        """Ask the engine which of the strings in ``text`` that look like special tokens are: one
        token when parsed as special, other tokens when not."""
        known = self._markers.keys() | self._not_markers
        for candidate in sorted(marker_candidates(text) - known)[:_LEARN_AT_ONCE]:
            if len(known) >= _MARKERS_MAX:
                return
            ids = await self.tokenize(candidate)
            if len(ids) == 1 and await self.tokenize(candidate, parse_special=False) != ids:
                self._markers[candidate] = ids[0]
            else:
                self._not_markers.add(candidate)
            known = self._markers.keys() | self._not_markers

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

        async def chunks() -> AsyncGenerator[dict[str, Any], None]:
            # Computing tokens into a slot is safe to repeat, and the second time llama-server
            # reuses what the first computed: a stream that broke is asked for once more.
            for attempt in (1, 2):
                response = await self._send(
                    "POST", "/completion", "prefill", payload, stream=True, safe=True
                )
                try:
                    async for chunk in self._chunks(response, "prefill"):
                        yield chunk
                    return
                except EngineStreamBrokenError as exc:
                    if attempt == 2:
                        raise
                    self.link.resent += 1
                    log.info("%s; computing the rest once more", exc.message)
                finally:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()

        stream = chunks()
        try:
            yield stream
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    @contextlib.asynccontextmanager
    async def complete(
        self, payload: Mapping[str, Any], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streamed raw ``/completion`` on ``slot`` (``payload`` holds ``prompt`` as token
        ids and the sampling settings); yields an iterator of its chunks. Leaving the block
        closes the response, which stops the generation."""
        body = {**payload, "id_slot": slot, "cache_prompt": True, "stream": True}
        response = await self._send("POST", "/completion", "completion", body, stream=True)
        try:
            yield self._chunks(response, "completion")
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def detokenize(self, tokens: list[int] | tuple[int, ...]) -> str:
        """The text of ``tokens``, as the engine's tokenizer writes it."""
        async with self._templating:
            data = await self._request_json(
                "POST", "/detokenize", "detokenize", json_body={"tokens": list(tokens)}
            )
        content = data.get("content") if isinstance(data, Mapping) else None
        if not isinstance(content, str):
            raise EngineResponseError(f"llama-server /detokenize returned {data!r:.200}")
        return content

    async def props(self) -> dict[str, Any]:
        """``GET /props``: the server's settings (``modalities``, ``default_generation_settings``,
        …)."""
        data = await self._request_json("GET", "/props", "props")
        if not isinstance(data, dict):
            raise EngineResponseError(f"llama-server /props returned {data!r:.200}")
        return data

    async def accepts_images(self) -> bool:
        """Whether the engine's model can see images (``/props`` ``modalities.vision``), asked
        once. A server too old to say is assumed to: it then refuses images itself."""
        if self._vision is None:
            try:
                modalities = (await self.props()).get("modalities")
            except EngineResponseError:  # no /props: an older server, or not llama-server
                modalities = None
            vision = modalities.get("vision") if isinstance(modalities, Mapping) else None
            self._vision = vision if isinstance(vision, bool) else True
        return self._vision

    async def metrics(self) -> str:
        """``GET /metrics`` (llama-server started with ``--metrics``): Prometheus text."""
        response = await self._send("GET", "/metrics", "metrics", safe=True)
        return response.text

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

    async def engine_state(self) -> tuple[str, str]:
        """What ``/health`` reports: ``("ready" | "engine_restarting" | "engine_unavailable",
        detail)``, from the supervisor's status where there is one, else from one probe."""
        if self.status is not None and self.status.state != "ready":
            return f"engine_{self.status.state}", self.status.detail
        state, detail = await probe(self._http, self.base_url)
        return ("ready", detail) if state == "ready" else ("engine_unavailable", detail)

    async def wait_ready(
        self,
        timeout: float,  # noqa: ASYNC109 - part of the public contract
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Poll ``/health`` until the model is loaded; :class:`EngineUnavailableError` after
        ``timeout`` seconds. ``on_progress`` hears each change of state in words."""
        await wait_until_ready(self._http, self.base_url, timeout=timeout, on_progress=on_progress)

    def set_reachable(self, reachable: bool, detail: str = "") -> bool:
        """Whether the engine answers, as a health watcher other than a supervisor finds it (a
        pool's probes): while it does not (``detail`` says why), calls fail at once instead of
        waiting on refused connections, and a stream that breaks first waits a moment for that
        verdict. The client keeps a status of its own for it from the first call on.

        An engine whose supervisor gave the status is the supervisor's to judge: False, and
        nothing changes.
        """
        if self.status is None:
            self.status = EngineStatus()
            self._own_status = True
        if not self._own_status:
            return False
        if reachable:
            self.status.set_state("ready")
        else:
            self.status.set_state("unavailable", detail)
        return True

    # -- what a pool of engines answers for all of them (see agentkv.runtime.pool) -----------

    @property
    def restarts(self) -> int:
        """The engine's restarts by its supervisor so far (none when not supervised here)."""
        return self.status.restarts if self.status is not None else 0

    def prompt_answers(self) -> PromptStats:
        """Where the prompt answers came from (:attr:`prompt_stats`)."""
        return self.prompt_stats

    def engines(self) -> tuple[EngineRow, ...] | None:
        """One row per engine for the operator, when this client stands for several."""
        return None

    async def watch(self, on_change: SlotsChanged | None = None) -> None:
        """Follow the engines' health, when this client stands for several; one engine's
        restarts are followed by its supervisor instead."""

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()
            await self._kept.aclose()

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
        safe: bool = True,
    ) -> Any:
        """One call with a JSON reply. ``safe``: the call may be repeated (everything but a chat
        completion), so a reply that breaks while it is read is asked for once more."""
        response = await self._send(method, path, what, json_body, params=params, safe=safe)
        return parse_json(response.text, what)

    def _chunks(self, response: httpx.Response, what: str) -> ChunkStream:
        """The chunks of a streamed reply to ``what``; a read that fails is this client's error."""

        async def engine_error(exc: Exception | None) -> EngineError:
            return await self._engine_error(exc, what, started=True)

        return ChunkStream(response, engine_error)

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
        status = self.status
        if status is not None and isinstance(error, EngineUnavailableError | EngineResponseError):
            if started and status.state == "ready":
                with anyio.move_on_after(_SETTLE_SECONDS):
                    await status.changed()
            restarting = status.error()
            if restarting is not None:
                return restarting
        return error

    async def _send(
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
            try:
                return await retrying(
                    self._send_once,
                    http,
                    method,
                    path,
                    what,
                    json_body,
                    params,
                    stream,
                    safe,
                    headers,
                )
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

    def _build(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        json_body: Any,
        params: Mapping[str, str] | None,
        stream: bool,
        extra: Mapping[str, str] | None = None,
    ) -> httpx.Request:
        headers = {**(extra or {}), **self._headers}
        if stream:
            # A stream's connection is never used again: llama-server may close it once the
            # stream ends, though it advertised keep-alive, and a pool would hand it out dead.
            headers["connection"] = "close"
        return http.build_request(
            method,
            self.base_url + path,
            json=json_body,
            params=params,
            headers=headers,
            timeout=self._timeout,
        )

    async def _send_once(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        what: str,
        json_body: Any,
        params: Mapping[str, str] | None,
        stream: bool,
        safe: bool,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        if self.status is not None and (refused := self.status.error()) is not None:
            raise refused
        self.link.requests += 1
        try:
            request = self._build(http, method, path, json_body, params, stream, headers)
            # Always sent as a stream: what failed before the reply's first byte (safe to send
            # again) is then told apart from what failed while reading it.
            response = await http.send(request, stream=True)
        except HTTPX_ERRORS as exc:
            raise await self._engine_error(exc, what, started=False) from exc
        if response.is_success and stream:
            return response
        try:
            await response.aread()
        except HTTPX_ERRORS as exc:
            error = await self._engine_error(exc, what, started=not safe)
            raise error from exc
        finally:
            await response.aclose()
        if response.is_success:
            return response
        error = status_error(response, what)
        if safe and response.status_code in GATEWAY_STATUSES:
            raise DroppedError(error.message) from error
        raise error
