"""What the gateway itself costs: agentkv against an in-process fake engine that answers at once.

Measured: latency added per request against the fake engine's own chat route (the same request
each time, whose templating and tokens agentkv keeps, then a new prompt each time), as wall time
and as this process's CPU time (which a loaded machine inflates far less); the stream relay rate;
memory per request that just ended and per idle agent (tracemalloc, after ``retry_grace``).

The fake engine streams one word per chunk, varied: a reply that repeats one piece is a
degenerate loop, which agentkv's repetition guard cuts short before the relay is measured.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import anyio

from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import RuntimeConfig
from agentkv_bench.drivers import Clients, open_stream, sdk_clients
from agentkv_bench.engines import serve_app
from agentkv_bench.fake_engine import FakeLlama
from agentkv_bench.report import percentile, rounded
from agentkv_server.app import create_app

__all__ = ["gateway_overhead"]

_WORDS = (
    "the", "slot", "holds", "a", "prefix", "of", "tokens", "so", "next", "request", "this",
    "agent", "computes", "only", "its", "own", "words", "while", "others", "wait", "in", "queue",
    "by", "priority", "and", "age", "until", "lease", "comes", "back",
)  # fmt: skip
#: How long a finished request is kept for a client's retry, in the bench (the default is 30 s).
_RETRY_GRACE = 0.2


def _words(n: int, seed: int = 0) -> tuple[str, ...]:
    """``n`` pieces of one word each, in a seeded random order (never a periodic text)."""
    rng = random.Random(seed)
    return tuple(rng.choice(_WORDS) + " " for _ in range(n))


async def _timed_stream(
    clients: Clients, api: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, float, int]:
    """Wall seconds and CPU seconds (this process) to the end of one streamed response (through
    the SDK of ``api``), and the number of SSE events the SDK read."""
    start, cpu = time.perf_counter(), time.process_time()
    events = 0
    async with await open_stream(clients, api, body, headers) as stream:
        async for _ in stream:
            events += 1
    return time.perf_counter() - start, time.process_time() - cpu, events


def _median_run(runs: Sequence[tuple[float, float, int]]) -> tuple[float, float, int]:
    """The run of median wall time (wall, CPU, events) of an odd or even number of runs."""
    return sorted(runs)[(len(runs) - 1) // 2]


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 3)


def _added(via: Sequence[float], direct: Sequence[float], q: float) -> float | None:
    return rounded((percentile(via, q) or 0) * 1000 - (percentile(direct, q) or 0) * 1000)


async def gateway_overhead(
    *,
    requests: int = 200,
    stream_chunks: int = 4000,
    stream_rounds: int = 5,
    idle_agents: int = 300,
) -> dict[str, Any]:
    """What agentkv adds on top of an engine that answers instantly (all in this process)."""
    words = _words(max(stream_chunks, 4))
    # Nothing kept per request: the fake runs in the process whose memory is measured.
    fake = FakeLlama(reply=words[:4], record=False, slots=2)
    message = {
        "model": "bench",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "ping"}],
    }
    chat = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 16, "stream": True}
    latency = {"x-agent-id": "latency"}
    async with serve_app(fake.asgi) as fake_url:
        # agentkv as `agentkv-server --upstream URL` builds it; the one default changed is how
        # long a finished request is kept for a retry (the memory figure waits that long).
        settings = EngineSettings(upstream=(fake_url,), slots=2)
        built = assemble(settings, RuntimeConfig(retry_grace=_RETRY_GRACE))
        async with (
            built as assembly,
            serve_app(create_app(assembly.runtime)) as gw_url,
            sdk_clients(fake_url, keep_alive=True, request_timeout=60) as engine,
            sdk_clients(gw_url, keep_alive=True, request_timeout=60) as gateway,
        ):
            direct, via, direct_cpu, via_cpu = [], [], [], []
            for i in range(requests + 20):
                d, dc, _ = await _timed_stream(engine, "chat", chat, {})
                v, vc, _ = await _timed_stream(gateway, "messages", message, latency)
                if i >= 20:  # the first ones warm up connections and code paths
                    direct.append(d)
                    via.append(v)
                    direct_cpu.append(dc)
                    via_cpu.append(vc)
            # The same with a new prompt each time: nothing of the engine's answers is kept.
            fresh, fresh_direct = [], []
            for i in range(requests // 2):
                fresh_direct.append((await _timed_stream(engine, "chat", chat, {}))[0])
                new_prompt = {**message, "messages": [{"role": "user", "content": f"ping {i}"}]}
                fresh.append((await _timed_stream(gateway, "messages", new_prompt, latency))[0])
            fake.reply = words[:stream_chunks]
            d_runs, v_runs = [], []
            for _ in range(stream_rounds):  # alternated; the median of each is reported
                d_runs.append(await _timed_stream(engine, "chat", chat, {}))
                v_runs.append(
                    await _timed_stream(gateway, "messages", message, {"x-agent-id": "stream"})
                )
            d_stream, _, d_events = _median_run(d_runs)
            v_stream, v_stream_cpu, v_events = _median_run(v_runs)
            fake.reply = words[:1]
            runtime = assembly.runtime
            stream_record = runtime.records()[-1]
            memory = await _idle_memory(gateway, message, idle_agents)
            known = len(runtime.snapshot().agents)

    return {
        "requests": requests,
        "direct_p50_ms": _ms(direct, 0.5),
        "direct_p99_ms": _ms(direct, 0.99),
        "agentkv_p50_ms": _ms(via, 0.5),
        "agentkv_p99_ms": _ms(via, 0.99),
        "added_p50_ms": _added(via, direct, 0.5),
        "added_p99_ms": _added(via, direct, 0.99),
        "new_prompt_requests": requests // 2,
        "added_new_prompt_p50_ms": _added(fresh, fresh_direct, 0.5),
        "direct_cpu_p50_ms": _ms(direct_cpu, 0.5),
        "agentkv_cpu_p50_ms": _ms(via_cpu, 0.5),
        "added_cpu_p50_ms": _added(via_cpu, direct_cpu, 0.5),
        "stream_engine_chunks": stream_chunks,
        "stream_rounds": stream_rounds,
        "stream_direct_s": round(d_stream, 4),
        "stream_agentkv_s": round(v_stream, 4),
        "stream_agentkv_cpu_s": round(v_stream_cpu, 4),
        "stream_stopped": stream_record.stopped,
        "engine_chunks_per_s": round(stream_chunks / v_stream),
        "sse_events_out": v_events,
        "sse_events_per_s": round(v_events / v_stream),
        # Per second of this process's CPU: what the relay would do on a core of its own.
        "sse_events_per_cpu_s": round(v_events / v_stream_cpu) if v_stream_cpu else None,
        "direct_chunks_per_s": round(d_events / d_stream),
        "agents_known": known,
        **memory,
    }


async def _idle_memory(clients: Clients, body: dict[str, Any], agents: int) -> dict[str, int]:
    """Bytes kept per agent that made one request: just after it (the finished request is still
    kept for a retry) and once it is idle (after ``retry_grace``)."""
    gc.collect()
    tracemalloc.start()
    try:
        await _agents_requests(clients, body, 0, 50)
        await anyio.sleep(2 * _RETRY_GRACE)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        await _agents_requests(clients, body, 50, 50 + agents)
        gc.collect()
        recent = tracemalloc.get_traced_memory()[0]
        await anyio.sleep(2 * _RETRY_GRACE)
        gc.collect()
        idle = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return {
        "bytes_per_recent_request": round((recent - base) / agents),
        "bytes_per_idle_agent": round((idle - base) / agents),
    }


async def _agents_requests(clients: Clients, body: dict[str, Any], first: int, stop: int) -> None:
    for i in range(first, stop):
        await _timed_stream(clients, "messages", body, {"x-agent-id": f"idle-{i}"})
