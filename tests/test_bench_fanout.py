"""The real-CLI fan-out's harness proxy, against a fake upstream (the real runs are a benchmark)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx

from agentkv_bench.fanout import CALLS, FanoutProxy, request_kind, targets

TOOLS = [{"name": "Agent", "input_schema": {"type": "object"}}, {"name": "Bash"}]


class Upstream:
    """A fake engine: streams one text delta per request; counts prompt tokens in /metrics."""

    def __init__(self, *, fail_continuation: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.computed = 0.0
        self.cached = 0.0
        self.fail_continuation = fail_continuation

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            text = (
                f"llamacpp:prompt_tokens_total {self.computed}\n"
                f"llamacpp:prompt_tokens_cached_total {self.cached}\n"
            )
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        self.bodies.append(body)
        continuation = any(m["role"] == "assistant" for m in body["messages"])
        if continuation:
            self.computed += 40
            self.cached += 960
        else:
            self.computed += 1000
        stream = (
            'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
            if not (continuation and self.fail_continuation)
            else 'event: error\ndata: {"type":"error"}\n\n'
        )
        # A stream, as the engine's reply is (a response built from text would be read already).
        return httpx.Response(
            200,
            stream=httpx.ByteStream(stream.encode()),
            headers={"content-type": "text/event-stream"},
        )


def _request(messages: list[dict[str, Any]], **headers: str) -> tuple[dict[str, Any], dict]:
    body = {"model": "m", "max_tokens": 4096, "stream": True, "tools": TOOLS, "messages": messages}
    return body, headers


FIRST = [{"role": "user", "content": "Split the work between two agents"}]
CONTINUATION = [
    *FIRST,
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Agent"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
]


async def _play(upstream: Upstream) -> tuple[FanoutProxy, list[httpx.Response]]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(upstream)) as http:
        proxy = FanoutProxy("http://engine", "http://engine")
        transport = httpx.ASGITransport(app=proxy.app(http))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            replies = []
            for messages, headers in (
                (FIRST, {}),
                (
                    [{"role": "user", "content": "Reply with the single word: front"}],
                    {"x-claude-code-agent-id": "a1"},
                ),
                (CONTINUATION, {}),
            ):
                body, _ = _request(messages)
                replies.append(await client.post("/v1/messages", json=body, headers=headers))
    return proxy, replies


def test_the_first_request_is_computed_then_answered_with_two_agent_calls() -> None:
    upstream = Upstream()
    proxy, replies = anyio.run(_play, upstream)
    # The engine computed the coordinator's prompt, for one token only.
    assert upstream.bodies[0]["max_tokens"] == 1
    assert upstream.bodies[0]["messages"] == FIRST
    # The CLI got the scripted reply: two foreground Agent calls, ending in tool_use.
    events = [
        json.loads(line[len("data: ") :])
        for line in replies[0].text.splitlines()
        if line.startswith("data: ")
    ]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    calls = [b for b in starts if b["type"] == "tool_use"]
    assert [c["name"] for c in calls] == ["Agent", "Agent"]
    assert [c["id"] for c in calls] == [call for call, _, _ in CALLS]
    stop = next(e for e in events if e["type"] == "message_delta")
    assert stop["delta"]["stop_reason"] == "tool_use"
    # The sub-agent and the continuation went upstream unchanged.
    assert [b["max_tokens"] for b in upstream.bodies[1:]] == [4096, 4096]
    kinds = [e.kind for e in proxy.exchanges]
    assert kinds == ["coordinator", "subagent", "continuation"]
    assert proxy.exchanges[1].agent == "a1"
    continuation = proxy.exchanges[2]
    assert (continuation.computed, continuation.cached) == (40, 960)
    assert continuation.first_delta is not None
    assert not any(e.error_event for e in proxy.exchanges)


def test_an_error_event_after_a_200_is_counted() -> None:
    proxy, replies = anyio.run(_play, Upstream(fail_continuation=True))
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert [e.error_event for e in proxy.exchanges] == [False, False, True]


def testrequest_kinds() -> None:
    body, _ = _request(FIRST)
    assert request_kind({}, body) == "coordinator"
    assert request_kind({"x-claude-code-agent-id": "a"}, body) == "subagent"
    assert request_kind({}, {**body, "messages": CONTINUATION}) == "continuation"
    assert request_kind({}, {**body, "tools": []}) == "other"


def _config(name: str, wall: float, fraction: float | None, errors: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "wall_s": wall,
        "continuation_fraction": fraction,
        "errors": errors,
        "rc": 0,
        "subagents": 2,
    }


def test_targets_hold_only_when_every_run_meets_them() -> None:
    good = {"configs": [_config("llama-server", 600, 0.02), _config("agentkv", 400, 0.01)]}
    slow = {"configs": [_config("llama-server", 600, 0.02), _config("agentkv", 610, 0.01)]}
    cold = {"configs": [_config("llama-server", 600, 0.02), _config("agentkv", 400, 0.5, 1)]}
    assert targets([good, good]) == {
        "every_run_beats_llama_server": True,
        "continuation_under_5_percent": True,
        "no_client_error": True,
    }
    assert targets([good, slow])["every_run_beats_llama_server"] is False
    missed = targets([good, cold])
    assert missed["continuation_under_5_percent"] is False
    assert missed["no_client_error"] is False
