"""The client side: agents as closed loops of streamed ``POST /v1/messages``, timed per request.

The same code drives every configuration. TTFT is submit → first ``content_block_delta``:
agentkv sends ``message_start`` at once and llama-server only when it starts generating, so the
first content delta is the comparable moment.
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

__all__ = ["Clock", "RequestResult", "drive", "one_request"]

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


async def one_request(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    clock: Callable[[], float],
) -> _Reply:
    """Stream one ``/v1/messages`` request and time it."""
    submitted = clock()
    first: float | None = None
    output = 0
    error: str | None = None
    text: list[str] = []
    async with http.stream("POST", url + "/v1/messages", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return _Reply(
                submitted, None, clock(), 0, f"HTTP {response.status_code}: {response.text}", ""
            )
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "content_block_delta":
                if first is None:
                    first = clock()
                delta = event.get("delta") or {}
                if isinstance(delta.get("text"), str):
                    text.append(delta["text"])
            elif kind == "message_delta":
                output = int(event.get("usage", {}).get("output_tokens", 0) or 0)
            elif kind == "error":
                error = json.dumps(event.get("error"))
    return _Reply(submitted, first, clock(), output, error, "".join(text))


def _headers(agent: Agent) -> dict[str, str]:
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
                    reply = await one_request(http, url, body, headers, clock)
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
