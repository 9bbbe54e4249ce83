"""What the gateway itself costs: agentkv against an in-process fake engine that answers at once.

Measured: latency added per request (agentkv's ``/v1/messages`` against the fake engine's own
chat route), the stream relay rate, and memory per idle agent (tracemalloc).
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_bench.engines import serve_app
from agentkv_bench.report import percentile, rounded
from agentkv_server.app import create_app

__all__ = ["fake_llama", "gateway_overhead"]


def fake_llama(chunks_per_reply: Callable[[], int]) -> Starlette:
    """A fake llama-server that answers at once: /health, and streamed chat completions."""

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def chat(request: Request) -> Response:
        body = await request.json()
        n = chunks_per_reply()

        async def stream() -> AsyncIterator[bytes]:
            piece = {"choices": [{"index": 0, "delta": {"content": "abcd"}, "finish_reason": None}]}
            data = b"data: " + json.dumps(piece).encode() + b"\n\n"
            for _ in range(n):
                yield data
            final = {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "timings": {"cache_n": 0, "prompt_n": len(body["messages"]), "predicted_n": n},
            }
            yield b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def apply_template(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"prompt": json.dumps(body["messages"])})

    async def tokenize(request: Request) -> Response:
        content = (await request.json())["content"]
        return JSONResponse({"tokens": [ord(c) for c in content[:: max(1, len(content) // 64)]]})

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/apply-template", apply_template, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
        ]
    )


async def _timed_stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, int]:
    """Seconds to the end of one streamed response, and its number of SSE data lines."""
    start = time.perf_counter()
    events = 0
    async with http.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            events += line.startswith("data:")
    return time.perf_counter() - start, events


async def gateway_overhead(
    *, requests: int = 200, stream_chunks: int = 4000, idle_agents: int = 300
) -> dict[str, Any]:
    """What agentkv adds on top of an engine that answers instantly (all in this process)."""
    chunks = {"n": 4}
    fake = fake_llama(lambda: chunks["n"])
    message = {
        "model": "bench",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "ping"}],
    }
    chat = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 16, "stream": True}
    async with serve_app(fake) as fake_url:
        client = LlamaSlotClient(fake_url)
        app = create_app(Runtime(client, RuntimeConfig(n_slots=2)))
        async with serve_app(app) as gw_url, httpx.AsyncClient(timeout=60) as http:
            direct, via = [], []
            for i in range(requests + 20):
                d, _ = await _timed_stream(http, fake_url + "/v1/chat/completions", chat, {})
                v, _ = await _timed_stream(
                    http, gw_url + "/v1/messages", message, {"x-agent-id": "latency"}
                )
                if i >= 20:  # the first ones warm up connections and code paths
                    direct.append(d)
                    via.append(v)
            chunks["n"] = stream_chunks
            d_stream, d_events = await _timed_stream(
                http, fake_url + "/v1/chat/completions", chat, {}
            )
            v_stream, v_events = await _timed_stream(
                http, gw_url + "/v1/messages", message, {"x-agent-id": "stream"}
            )
            chunks["n"] = 1
            runtime = app.state.runtime
            gc.collect()
            tracemalloc.start()
            try:
                await _agents_requests(http, gw_url, message, 0, 50)
                gc.collect()
                base = tracemalloc.get_traced_memory()[0]
                await _agents_requests(http, gw_url, message, 50, 50 + idle_agents)
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            known = len(runtime.table()["agents"])
        await client.aclose()

    def ms(values: Sequence[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value * 1000, 3)

    return {
        "requests": requests,
        "direct_p50_ms": ms(direct, 0.5),
        "direct_p99_ms": ms(direct, 0.99),
        "agentkv_p50_ms": ms(via, 0.5),
        "agentkv_p99_ms": ms(via, 0.99),
        "added_p50_ms": rounded((percentile(via, 0.5) or 0) * 1000 - (ms(direct, 0.5) or 0)),
        "added_p99_ms": rounded((percentile(via, 0.99) or 0) * 1000 - (ms(direct, 0.99) or 0)),
        "stream_engine_chunks": stream_chunks,
        "stream_direct_s": round(d_stream, 4),
        "stream_agentkv_s": round(v_stream, 4),
        "engine_chunks_per_s": round(stream_chunks / v_stream),
        "sse_events_out": v_events,
        "sse_events_per_s": round(v_events / v_stream),
        "direct_chunks_per_s": round(d_events / d_stream),
        "agents_known": known,
        "bytes_per_idle_agent": round((grown - base) / idle_agents),
    }


async def _agents_requests(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], first: int, stop: int
) -> None:
    for i in range(first, stop):
        await _timed_stream(http, url + "/v1/messages", body, {"x-agent-id": f"idle-{i}"})
