"""The client side: agents as closed loops of streamed requests, timed per request.

The same code drives every configuration, through the official SDKs (:class:`Clients`): an agent
speaks Anthropic Messages (Claude Code's), OpenAI Responses (Codex's) or Chat Completions
(:data:`ROUTES`). A captured body is sent as it is: the fields an SDK method names are passed to
it, the rest as ``extra_body``, and the agent's headers as ``extra_headers``.

TTFT is submit → the SDK's first streamed event of content (text or a tool call's input): agentkv
sends ``message_start`` / ``response.created`` at once and llama-server only when it starts
generating, so the first content delta is the comparable moment.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anthropic
import anyio
import attrs
import openai

from agentkv_bench.workload import Agent, Workload

__all__ = [
    "ROUTES",
    "Clients",
    "Clock",
    "RequestResult",
    "StreamEvent",
    "agent_headers",
    "drive",
    "one_request",
    "open_stream",
    "read_event",
    "sdk_clients",
]

#: A small stagger between agents that start together makes the arrival order the same in every
#: configuration.
STAGGER = 0.05


class Clock:
    """Seconds since the clock was made (one clock for a whole configuration's run)."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._start


@attrs.frozen
class RequestResult:
    """One request as the client saw it. Times are seconds on the run's clock."""

    agent: str
    priority: int
    turn: int
    submitted: float
    ttft: float | None
    done: float
    output_tokens: int
    error: str | None = None
    session: int = 0
    phase: str = ""
    text: str = ""


@attrs.frozen
class _Reply:
    submitted: float
    first: float | None
    done: float
    output_tokens: int
    error: str | None
    text: str

    def result(self, agent: str, priority: int, turn: int, **fields: Any) -> RequestResult:
        """The reply as its request's result (times rounded, the text's first 200 characters)."""
        return RequestResult(
            agent=agent,
            priority=priority,
            turn=turn,
            submitted=round(self.submitted, 4),
            ttft=None if self.first is None else round(self.first - self.submitted, 4),
            done=round(self.done, 4),
            output_tokens=self.output_tokens,
            error=self.error,
            text=self.text[:200],
            **fields,
        )


#: Each API's route.
ROUTES = {
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "chat": "/v1/chat/completions",
}


@attrs.frozen
class StreamEvent:
    """What one streamed event says, whatever the API: content arrived (``text`` is its visible
    part), the reply's output token count, or an error."""

    content: bool = False
    text: str = ""
    output_tokens: int | None = None
    error: str | None = None


def _messages_event(event: dict[str, Any]) -> StreamEvent:
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        text = delta.get("text")
        return StreamEvent(content=True, text=text if isinstance(text, str) else "")
    if kind == "message_delta":
        return StreamEvent(output_tokens=int(event.get("usage", {}).get("output_tokens", 0) or 0))
    return StreamEvent()


def _responses_event(event: dict[str, Any]) -> StreamEvent:
    kind = event.get("type")
    if kind == "response.output_text.delta":
        delta = event.get("delta")
        return StreamEvent(content=True, text=delta if isinstance(delta, str) else "")
    if kind == "response.function_call_arguments.delta":
        return StreamEvent(content=True)
    if kind == "response.completed":
        usage = (event.get("response") or {}).get("usage") or {}
        return StreamEvent(output_tokens=int(usage.get("output_tokens", 0) or 0))
    if kind in ("response.failed", "error"):
        failed = (event.get("response") or {}).get("error") if kind == "response.failed" else None
        return StreamEvent(error=json.dumps(failed or event.get("error") or event))
    return StreamEvent()


def _chat_event(event: dict[str, Any]) -> StreamEvent:
    usage = event.get("usage")
    tokens = int(usage.get("completion_tokens", 0) or 0) if isinstance(usage, dict) else None
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text or delta.get("tool_calls"):
            return StreamEvent(
                content=True, text=text if isinstance(text, str) else "", output_tokens=tokens
            )
    return StreamEvent(output_tokens=tokens)


_READERS: dict[str, Callable[[dict[str, Any]], StreamEvent]] = {
    "messages": _messages_event,
    "responses": _responses_event,
    "chat": _chat_event,
}


def read_event(api: str, event: Mapping[str, Any]) -> StreamEvent:
    """What one streamed event of ``api`` says (the SDK's event, as a dict). An ``error`` event
    of a Messages or Chat stream is not one: the SDKs raise it (:func:`one_request`)."""
    return _READERS[api](dict(event))


@attrs.frozen
class Clients:
    """The official SDK clients of one configuration: Anthropic's for Messages, OpenAI's for
    Responses and Chat Completions. They never retry: a failed request is a result."""

    anthropic: anthropic.AsyncAnthropic
    openai: openai.AsyncOpenAI


@contextlib.asynccontextmanager
async def sdk_clients(
    url: str, *, connections: int = 16, request_timeout: float = 3600.0, keep_alive: bool = False
) -> AsyncIterator[Clients]:
    """Both SDKs' clients for the server at ``url``, at most ``connections`` open at once, a
    request's limit ``request_timeout`` seconds.

    No keep-alive by default: llama-server closes idle connections after a few seconds, and a
    request sent on one it is closing fails; a fresh loopback connection per request costs ~1 ms.
    """
    keep = connections if keep_alive else 0

    def options(sdk: Any) -> dict[str, Any]:
        # The SDK's own HTTP library's Limits (the type of its default limits).
        limits = type(sdk.DEFAULT_CONNECTION_LIMITS)(
            max_connections=connections, max_keepalive_connections=keep
        )
        return {
            "api_key": "bench",
            "max_retries": 0,
            "timeout": sdk.Timeout(request_timeout, connect=10.0),
            "http_client": sdk.DefaultAsyncHttpxClient(limits=limits),
        }

    async with (
        anthropic.AsyncAnthropic(base_url=url, **options(anthropic)) as messages,
        openai.AsyncOpenAI(base_url=url + "/v1", **options(openai)) as other,
    ):
        yield Clients(messages, other)


#: The body fields each API's SDK method takes by name; the rest go as ``extra_body``.
_NAMED = {
    "messages": ("model", "max_tokens", "messages", "stream"),
    "responses": ("stream",),
    "chat": ("model", "messages", "stream"),
}


async def open_stream(
    clients: Clients, api: str, body: Mapping[str, Any], headers: Mapping[str, str]
) -> anthropic.AsyncStream[Any] | openai.AsyncStream[Any]:
    """The SDK's stream of ``api`` for ``body``, sent as it is (see the module)."""
    rest = {k: v for k, v in body.items() if k not in _NAMED[api]}
    if api == "messages":
        return await clients.anthropic.messages.create(
            model=body["model"],
            max_tokens=body["max_tokens"],
            messages=body["messages"],
            stream=True,
            extra_headers=dict(headers),
            extra_body=rest,
        )
    if api == "responses":
        return await clients.openai.responses.create(
            stream=True, extra_headers=dict(headers), extra_body=rest
        )
    return await clients.openai.chat.completions.create(
        # A Chat body agentkv's translator wrote names no model: none is sent.
        model=body.get("model", openai.NOT_GIVEN),
        messages=body["messages"],
        stream=True,
        extra_headers=dict(headers),
        extra_body=rest,
    )


def _error_text(body: object) -> str:
    """An error body as a report shows it: Anthropic's ``{"type": "error", "error": {...}}``
    as its inner object, anything else as it is."""
    if isinstance(body, Mapping) and body.get("type") == "error" and "error" in body:
        return json.dumps(body["error"])
    return json.dumps(body)


async def one_request(
    clients: Clients,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    clock: Callable[[], float],
    *,
    api: str = "messages",
) -> _Reply:
    """Stream one request of ``api`` (:data:`ROUTES`) and time it. Any failure is recorded in
    the reply, not raised: one broken request must not lose the whole run."""
    submitted = clock()
    first: float | None = None
    output = 0
    error: str | None = None
    text: list[str] = []
    read = _READERS[api]
    try:
        async with await open_stream(clients, api, body, headers) as stream:
            async for item in stream:
                event = read(item.to_dict())
                if event.content and first is None:
                    first = clock()
                text.append(event.text)
                if event.output_tokens is not None:
                    output = event.output_tokens
                if event.error is not None:
                    error = event.error
    except (anthropic.APIStatusError, openai.APIStatusError) as exc:
        if exc.status_code != 200:
            reason = f"HTTP {exc.status_code}: {exc.response.text}"
            return _Reply(submitted, None, clock(), 0, reason, "")
        error = _error_text(exc.body)  # an error event in the stream (the SDK raises it)
    except (anthropic.APIConnectionError, openai.APIConnectionError) as exc:
        return _Reply(submitted, None, clock(), 0, repr(exc), "")
    except openai.APIError as exc:
        error = _error_text(exc.body)  # an error object in a Chat stream (the SDK raises it)
    except Exception as exc:  # a stream cut midway: the error of the SDK's HTTP library
        return _Reply(submitted, None, clock(), 0, repr(exc), "")
    return _Reply(submitted, first, clock(), output, error, "".join(text))


def agent_headers(agent: str, priority: int, api_key: str = "bench") -> dict[str, str]:
    """The headers of a Messages request from ``agent``, named by agentkv's own ``X-Agent-Id``."""
    return {
        "x-api-key": api_key,
        "anthropic-version": "2023-06-01",
        "x-agent-id": agent,
        "x-agent-priority": str(priority),
    }


async def drive(
    url: str, workload: Workload, *, clock: Clock | None = None, phase: str = ""
) -> tuple[float, list[RequestResult]]:
    """Run every agent's requests against ``url``, each agent a closed loop from its ``start``;
    returns (wall seconds from the first start to the last reply, results)."""
    clock = clock or Clock()
    results: list[RequestResult] = []
    began = clock()
    async with sdk_clients(url, connections=len(workload.agents) + 2) as clients:

        async def run_agent(index: int, agent: Agent) -> None:
            await anyio.sleep(agent.start + STAGGER * index)
            headers = dict(agent.headers) or agent_headers(agent.name, agent.priority)
            for turn, body in enumerate(agent.requests):
                reply = await one_request(clients, body, headers, clock, api=agent.api)
                session = agent.session_of(turn)
                results.append(
                    reply.result(agent.name, agent.priority, turn, session=session, phase=phase)
                )

        async with anyio.create_task_group() as tg:
            for index, agent in enumerate(workload.agents):
                tg.start_soon(run_agent, index, agent)
    return clock() - began, results
