"""The client side: agents as closed loops of streamed requests, timed per request.

The same code drives every configuration. An agent speaks one API (:data:`ROUTES`): Anthropic
Messages (``POST /v1/messages``, Claude Code), OpenAI Responses (``POST /v1/responses``, Codex) or
Chat Completions (``POST /v1/chat/completions``). TTFT is submit → the first delta of content
(text or a tool call's input): agentkv sends ``message_start`` / ``response.created`` at once and
llama-server only when it starts generating, so the first content delta is the comparable moment.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import httpx

from agentkv_bench.workload import Agent, Workload

__all__ = ["ROUTES", "Clock", "RequestResult", "StreamEvent", "drive", "one_request", "read_event"]

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
    if kind == "error":
        return StreamEvent(error=json.dumps(event.get("error")))
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
    if "error" in event:
        return StreamEvent(error=json.dumps(event["error"]))
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


def read_event(api: str, data: str) -> StreamEvent:
    """One SSE ``data:`` payload of ``api``'s stream (``[DONE]`` ends a Chat stream: nothing)."""
    data = data.strip()
    if not data or data == "[DONE]":
        return StreamEvent()
    event = json.loads(data)
    return _READERS[api](event) if isinstance(event, dict) else StreamEvent()


async def one_request(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    clock: Callable[[], float],
    *,
    api: str = "messages",
) -> _Reply:
    """Stream one request to ``api``'s route (:data:`ROUTES`) and time it."""
    submitted = clock()
    first: float | None = None
    output = 0
    error: str | None = None
    text: list[str] = []
    route = url + ROUTES[api]
    async with http.stream("POST", route, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return _Reply(
                submitted, None, clock(), 0, f"HTTP {response.status_code}: {response.text}", ""
            )
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = read_event(api, line[5:])
            if event.content and first is None:
                first = clock()
            text.append(event.text)
            if event.output_tokens is not None:
                output = event.output_tokens
            if event.error is not None:
                error = event.error
    return _Reply(submitted, first, clock(), output, error, "".join(text))


def _headers(agent: Agent) -> dict[str, str]:
    if agent.headers:
        return dict(agent.headers)
    return {
        "x-api-key": "bench",
        "anthropic-version": "2023-06-01",
        "x-agent-id": agent.name,
        "x-agent-priority": str(agent.priority),
    }


async def drive(
    url: str, workload: Workload, *, clock: Clock | None = None, phase: str = ""
) -> tuple[float, list[RequestResult]]:
    """Run every agent's requests against ``url``, each agent a closed loop from its ``start``;
    returns (wall seconds from the first start to the last reply, results)."""
    clock = clock or Clock()
    results: list[RequestResult] = []
    began = clock()
    # No keep-alive: llama-server closes idle connections after a few seconds, and a request
    # sent on one it is closing fails; a fresh loopback connection per request costs ~1 ms.
    limits = httpx.Limits(max_connections=len(workload.agents) + 2, max_keepalive_connections=0)
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:

        async def run_agent(index: int, agent: Agent) -> None:
            await anyio.sleep(agent.start + STAGGER * index)
            headers = _headers(agent)
            for turn, body in enumerate(agent.requests):
                try:
                    reply = await one_request(http, url, body, headers, clock, api=agent.api)
                except httpx.HTTPError as exc:
                    # Recorded, not raised: one broken request must not lose the whole run.
                    now = clock()
                    reply = _Reply(now, None, now, 0, repr(exc), "")
                results.append(
                    RequestResult(
                        agent=agent.name,
                        priority=agent.priority,
                        turn=turn,
                        submitted=round(reply.submitted, 4),
                        ttft=None
                        if reply.first is None
                        else round(reply.first - reply.submitted, 4),
                        done=round(reply.done, 4),
                        output_tokens=reply.output_tokens,
                        error=reply.error,
                        session=agent.session_of(turn),
                        phase=phase,
                        text=reply.text[:200],
                    )
                )

        async with anyio.create_task_group() as tg:
            for index, agent in enumerate(workload.agents):
                tg.start_soon(run_agent, index, agent)
    return clock() - began, results
