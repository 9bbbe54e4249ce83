"""The multi-agent benchmark: agentkv against llama-server alone, side by side in one run.

One run starts the same llama-server binary with the same model and slot count three times, each
a fresh process so every cache starts cold:

- ``plain``: llama-server with its own defaults, driven through its own ``/v1/messages``;
- ``tuned``: llama-server with flags chosen by hand for many agents, driven the same way;
- ``agentkv``: agentkv's own launch of llama-server with agentkv's gateway in front.

The same client code (httpx, streaming ``POST /v1/messages``) drives the same seeded workload
(:mod:`agentkv_server._workload`) against all three. Prefill is read from llama-server's own
counters (``GET /metrics``, ``llamacpp:prompt_tokens_total``), so no configuration reports on
itself. A second part measures what the gateway costs against a fake engine that answers at once.

Run ``python -m agentkv_server.bench`` (``--quick`` for the CI-sized version).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv import LlamaSlotClient, MessagesTranslator
from agentkv.runtime.client import probe
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server, free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.model import default_model_path
from agentkv_server._workload import (
    Workload,
    WorkloadSpec,
    build_workload,
    minimum_prefill,
)
from agentkv_server.app import create_app

__all__ = ["TUNED_ARGS", "main", "run_benchmark"]

#: The hand-tuned flags of the ``tuned`` configuration; see docs/benchmarks.md for how they were
#: chosen. -sps 0: no similarity-based slot choice (it thrashes with many agents); --cache-ram:
#: keep evicted prompts in host RAM and restore them (explicitly sized; the default is 8 GiB).
TUNED_ARGS: tuple[str, ...] = ("-sps", "0", "--cache-ram", "4096")

_LABELS = {
    "plain": "llama-server (defaults)",
    "tuned": "llama-server (tuned)",
    "agentkv": "agentkv + llama-server",
}


# -- results ------------------------------------------------------------------------------------


@attrs.frozen
class RequestResult:
    """One request as the client saw it. Times are seconds since the run started."""

    agent: str
    priority: int
    turn: int
    submitted: float
    ttft: float | None
    done: float
    output_tokens: int
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _metric(text: str, name: str) -> float:
    """One counter from Prometheus text (``llamacpp:prompt_tokens_total 168``); 0 if absent."""
    match = re.search(rf"^{re.escape(name)}\s+([0-9.eE+-]+)\s*$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


_COUNTERS = {
    "prompt_computed": "llamacpp:prompt_tokens_total",
    "prompt_cached": "llamacpp:prompt_tokens_cached_total",
    "predicted": "llamacpp:tokens_predicted_total",
    "prompt_seconds": "llamacpp:prompt_seconds_total",
}


async def _counters(http: httpx.AsyncClient, engine_url: str) -> dict[str, float]:
    response = await http.get(engine_url + "/metrics", timeout=30)
    response.raise_for_status()
    return {key: _metric(response.text, name) for key, name in _COUNTERS.items()}


# -- engines ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _raw_llama_server(
    binary: Path, args: list[str], log_path: Path, *, startup_timeout: float = 300.0
) -> AsyncIterator[str]:
    """llama-server started with exactly ``args`` (plus a free port); yields its URL."""
    port = free_port()
    command = [str(binary), *args, "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        process = await anyio.open_process(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + startup_timeout
            async with httpx.AsyncClient() as http:
                while (await probe(http, url))[0] != "ready":
                    if process.returncode is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"llama-server did not start; see {log_path}")
                    await anyio.sleep(0.2)
            yield url
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                    with anyio.move_on_after(10):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                await process.aclose()


@contextlib.asynccontextmanager
async def _serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port, in this event loop."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        # uvicorn exposes readiness only as a flag.
        while not server.started:  # noqa: ASYNC110
            await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


@contextlib.asynccontextmanager
async def _agentkv(
    binary: Path, model: Path, slots: int, ctx: int, log_dir: Path
) -> AsyncIterator[tuple[str, str]]:
    """agentkv's own launch of llama-server plus its gateway; yields (gateway URL, engine URL)."""
    # As agentkv-server launches it: with a slot-save directory, so evicted contexts are parked.
    config = EngineConfig(
        model=model, slots=slots, ctx_per_slot=ctx, port=0, slot_save_dir=log_dir / "slots"
    )
    async with LlamaServerProcess(config, binary=binary, log_dir=log_dir) as engine:
        client = LlamaSlotClient(engine.base_url)
        try:
            runtime_config = RuntimeConfig(
                n_slots=slots, ctx_per_slot=ctx, store_dir=log_dir / "slots"
            )
            app = create_app(Runtime(client, runtime_config))
            async with _serve(app) as url:
                yield url, engine.base_url
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


# -- the client -----------------------------------------------------------------------------------


async def _one_request(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    clock: Callable[[], float],
) -> tuple[float, float | None, float, int, str | None]:
    """Stream one /v1/messages request: (submitted, first content byte, done, output tokens,
    error)."""
    submitted = clock()
    first: float | None = None
    output = 0
    error: str | None = None
    async with http.stream("POST", url + "/v1/messages", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return submitted, None, clock(), 0, f"HTTP {response.status_code}: {response.text}"
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "content_block_delta" and first is None:
                first = clock()
            elif kind == "message_delta":
                output = int(event.get("usage", {}).get("output_tokens", 0) or 0)
            elif kind == "error":
                error = json.dumps(event.get("error"))
    return submitted, first, clock(), output, error


async def drive(url: str, workload: Workload) -> tuple[float, list[RequestResult]]:
    """Run every agent's conversation against ``url``, closed loop; (wall seconds, results)."""
    results: list[RequestResult] = []
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    # No keep-alive: llama-server closes idle connections after a few seconds, and a request
    # sent on one it is closing fails; a fresh loopback connection per request costs ~1 ms.
    limits = httpx.Limits(max_connections=len(workload.agents) + 2, max_keepalive_connections=0)
    timeout = httpx.Timeout(900.0, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:

        async def run_agent(index: int) -> None:
            agent = workload.agents[index]
            # A small stagger makes the arrival order the same in every configuration.
            await anyio.sleep(0.05 * index)
            headers = {
                "x-api-key": "bench",
                "anthropic-version": "2023-06-01",
                "x-agent-id": agent.name,
                "x-agent-priority": str(agent.priority),
            }
            for turn, body in enumerate(agent.requests):
                try:
                    submitted, first, done, output, error = await _one_request(
                        http, url, body, headers, clock
                    )
                except httpx.HTTPError as exc:
                    # Recorded, not raised: one broken request must not lose the whole run.
                    submitted = first = done = clock()
                    first, output, error = None, 0, repr(exc)
                results.append(
                    RequestResult(
                        agent=agent.name,
                        priority=agent.priority,
                        turn=turn,
                        submitted=round(submitted, 4),
                        ttft=None if first is None else round(first - submitted, 4),
                        done=round(done, 4),
                        output_tokens=output,
                        error=error,
                    )
                )

        async with anyio.create_task_group() as tg:
            for index in range(len(workload.agents)):
                tg.start_soon(run_agent, index)
    return clock(), results


# -- one configuration --------------------------------------------------------------------------


def summarize(
    name: str,
    wall: float,
    results: Sequence[RequestResult],
    counters: dict[str, float],
    minimum: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The report for one configuration (plain JSON values)."""
    computed = int(counters["prompt_computed"])
    cached = int(counters["prompt_cached"])
    total = computed + cached
    ttfts = [r.ttft for r in results if r.ttft is not None]
    by_priority: dict[str, dict[str, Any]] = {}
    for priority in sorted({r.priority for r in results}):
        values = [r.ttft for r in results if r.priority == priority and r.ttft is not None]
        by_priority[f"P{priority}"] = {
            "requests": sum(1 for r in results if r.priority == priority),
            "ttft_p50_s": _round(percentile(values, 0.5)),
            "ttft_p95_s": _round(percentile(values, 0.95)),
        }
    output = sum(r.output_tokens for r in results)
    return {
        "name": name,
        "label": _LABELS.get(name, name),
        **extra,
        "wall_s": round(wall, 2),
        "requests": len(results),
        "errors": sum(1 for r in results if r.error is not None),
        "prompt_tokens_total": total,
        "prefill_computed": computed,
        "prefill_minimum": minimum,
        "prefill_ratio": round(computed / minimum, 3) if minimum else None,
        "cache_hit_ratio": round(1 - computed / total, 4) if total else None,
        "prefill_seconds": round(counters["prompt_seconds"], 2),
        "ttft": by_priority,
        "ttft_p50_s": _round(percentile(ttfts, 0.5)),
        "ttft_p95_s": _round(percentile(ttfts, 0.95)),
        "longest_wait_s": _round(max(ttfts, default=None)),
        "output_tokens": output,
        "engine_output_tokens": int(counters["predicted"]),
        "output_tokens_per_s": round(output / wall, 2) if wall else None,
        "per_request": [attrs.asdict(r) for r in results],
    }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


async def _token_sequences(engine_url: str, workload: Workload) -> list[list[int]]:
    """Token ids of every request's prompt, as the engine templates and tokenizes it, in the
    workload's canonical order (through agentkv's translation)."""
    translator = MessagesTranslator()
    sequences = []
    async with LlamaSlotClient(engine_url) as client:
        for _agent, _turn, body in workload.canonical_order():
            engine_body = translator.translate(body).body
            prompt = await client.apply_template(engine_body)
            sequences.append(await client.tokenize(prompt, add_special=True))
    return sequences


async def _run_config(
    name: str,
    *,
    binary: Path,
    model: Path,
    workload: Workload,
    ctx: int,
    tuned_args: Sequence[str],
    out: Path,
    minimum: list[int],
    say: Callable[[str], None],
) -> dict[str, Any]:
    slots = workload.spec.slots
    base = ["-m", str(model), "-np", str(slots), "-c", str(slots * ctx), "--metrics"]
    async with contextlib.AsyncExitStack() as stack:
        if name == "agentkv":
            url, engine_url = await stack.enter_async_context(
                _agentkv(binary, model, slots, ctx, out / "logs")
            )
            flags = "agentkv's own launch (EngineConfig)"
        else:
            args = base + (list(tuned_args) if name == "tuned" else [])
            url = engine_url = await stack.enter_async_context(
                _raw_llama_server(binary, args, out / "logs" / f"llama-server-{name}.log")
            )
            flags = " ".join(args[2:])
        if not minimum:
            # Token counts need a running engine; the first one computes them once for all.
            sequences = await _token_sequences(engine_url, workload)
            minimum.append(minimum_prefill(sequences))
            minimum.append(sum(len(s) for s in sequences))
        async with httpx.AsyncClient() as http:
            before = await _counters(http, engine_url)
            say(f"{name}: running {workload.n_requests} requests")
            wall, results = await drive(url, workload)
            after = await _counters(http, engine_url)
    counters = {key: after[key] - before[key] for key in after}
    report = summarize(name, wall, results, counters, minimum[0], {"flags": flags})
    report["prefill_naive"] = minimum[1]
    return report


# -- the gateway's own cost ---------------------------------------------------------------------


def _fake_llama(chunks_per_reply: Callable[[], int]) -> Starlette:
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
    fake = _fake_llama(lambda: chunks["n"])
    message = {
        "model": "bench",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "ping"}],
    }
    chat = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 16, "stream": True}
    async with _serve(fake) as fake_url:
        client = LlamaSlotClient(fake_url)
        app = create_app(Runtime(client, RuntimeConfig(n_slots=2)))
        async with _serve(app) as gw_url, httpx.AsyncClient(timeout=60) as http:
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
        "added_p50_ms": _round((percentile(via, 0.5) or 0) * 1000 - (ms(direct, 0.5) or 0)),
        "added_p99_ms": _round((percentile(via, 0.99) or 0) * 1000 - (ms(direct, 0.99) or 0)),
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


# -- the whole run ------------------------------------------------------------------------------


async def run_benchmark(
    spec: WorkloadSpec,
    *,
    out: Path,
    configs: Sequence[str] = ("plain", "tuned", "agentkv"),
    ctx: int = 4096,
    tuned_args: Sequence[str] = TUNED_ARGS,
    overhead: bool = True,
    binary: Path | None = None,
    model: Path | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the configurations one after another and return the report (also written to ``out``)."""
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    binary = binary or find_llama_server()
    model = model or default_model_path()
    workload = build_workload(spec)
    started = time.monotonic()
    minimum: list[int] = []
    reports = []
    for name in configs:
        say(f"{name}: starting llama-server")
        reports.append(
            await _run_config(
                name,
                binary=binary,
                model=model,
                workload=workload,
                ctx=ctx,
                tuned_args=tuned_args,
                out=out,
                minimum=minimum,
                say=say,
            )
        )
        say(f"{name}: {reports[-1]['wall_s']} s")
    report: dict[str, Any] = {
        "workload": attrs.asdict(spec),
        "ctx_per_slot": ctx,
        "engine": binary.name,
        "model": model.name,
        "machine": f"{platform.machine()}, {_cpus()} CPUs",
        "prefill_minimum": minimum[0] if minimum else None,
        "prefill_naive": minimum[1] if minimum else None,
        "configs": reports,
    }
    if overhead:
        say("gateway overhead: fake engine")
        report["gateway_overhead"] = await gateway_overhead()
    report["total_s"] = round(time.monotonic() - started, 1)
    await anyio.Path(out / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    await anyio.Path(out / "benchmarks.txt").write_text(table(report) + "\n")
    await anyio.to_thread.run_sync(chart, report, out / "benchmarks.png")
    return report


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def table(report: dict[str, Any]) -> str:
    """The report as a plain-text table (one column per configuration)."""
    configs = report["configs"]
    priorities = sorted({p for c in configs for p in c["ttft"]})

    def fmt(value: Any, unit: str = "") -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
        return f"{value}{unit}"

    rows: list[tuple[str, list[str]]] = [
        ("wall time", [fmt(c["wall_s"], " s") for c in configs]),
        ("prefill computed (tokens)", [fmt(c["prefill_computed"]) for c in configs]),
        ("prefill / minimum", [fmt(c["prefill_ratio"], "×") for c in configs]),
        ("cache-hit ratio", [fmt(c["cache_hit_ratio"]) for c in configs]),
    ]
    for p in priorities:
        rows.append(
            (
                f"TTFT {p} p50 / p95",
                [
                    f"{fmt(c['ttft'].get(p, {}).get('ttft_p50_s'), ' s')} / "
                    f"{fmt(c['ttft'].get(p, {}).get('ttft_p95_s'), ' s')}"
                    for c in configs
                ],
            )
        )
    rows += [
        ("longest wait", [fmt(c["longest_wait_s"], " s") for c in configs]),
        ("output tokens / s", [fmt(c["output_tokens_per_s"]) for c in configs]),
        ("errors", [fmt(c["errors"]) for c in configs]),
    ]
    header = ["", *(c["label"] for c in configs)]
    widths = [max(len(r[0]) for r in rows)] + [
        max(len(header[i + 1]), *(len(r[1][i]) for r in rows)) for i in range(len(configs))
    ]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    lines = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line([name, *cells]) for name, cells in rows]
    spec = report["workload"]
    lines.append(
        f"\n{spec['agents']} agents on {spec['slots']} slots, {spec['turns']} turns each; "
        f"minimum prefill {report['prefill_minimum']} tokens, "
        f"without any cache {report['prefill_naive']}."
    )
    overhead = report.get("gateway_overhead")
    if overhead:
        lines.append(
            f"Gateway overhead (fake engine): +{overhead['added_p50_ms']} ms p50, "
            f"+{overhead['added_p99_ms']} ms p99 per request; "
            f"{overhead['engine_chunks_per_s']} engine chunks/s "
            f"({overhead['sse_events_per_s']} SSE events/s) relayed; "
            f"{overhead['bytes_per_idle_agent']} bytes per idle agent."
        )
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Three bar charts side by side: wall time, prefill / minimum, P0 p95 TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report["configs"]
    labels = [c["label"].replace(" + ", "\n+ ").replace(" (", "\n(") for c in configs]
    colors = ["#999999", "#5b8fd1", "#2ca25f", "#d95f02"][: len(configs)]
    panels = [
        ("wall time (s)", [c["wall_s"] for c in configs]),
        ("prefill computed / minimum", [c["prefill_ratio"] or 0 for c in configs]),
        ("P0 TTFT p95 (s)", [c["ttft"].get("P0", {}).get("ttft_p95_s") or 0 for c in configs]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (title, values) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.set_title(title)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.margins(y=0.15)
    spec = report["workload"]
    fig.suptitle(
        f"{spec['agents']} agents on {spec['slots']} slots, {spec['turns']} turns each "
        f"(lower is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-bench",
        description="Multi-agent benchmark: agentkv against llama-server alone, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="the small CI-sized workload")
    parser.add_argument("--agents", type=int, help="number of agents (default 6; quick 3)")
    parser.add_argument("--slots", type=int, help="llama-server slots (default 2)")
    parser.add_argument("--turns", type=int, help="requests per agent (default 4; quick 2)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="context per slot")
    parser.add_argument(
        "--configs",
        default="plain,tuned,agentkv",
        help="comma list of plain, tuned, agentkv (default: all three)",
    )
    parser.add_argument(
        "--tuned-args",
        default=" ".join(TUNED_ARGS),
        help=f"extra llama-server flags of the tuned config (default: {' '.join(TUNED_ARGS)})",
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the gateway-overhead micro-benchmark"
    )
    parser.add_argument(
        "--overhead-only", action="store_true", help="only the gateway-overhead micro-benchmark"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the bundled one)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.overhead_only:
        print(json.dumps(anyio.run(gateway_overhead), indent=2))
        return 0
    spec = WorkloadSpec.quick(args.seed) if args.quick else WorkloadSpec(seed=args.seed)
    changes = {
        k: v
        for k, v in (("agents", args.agents), ("slots", args.slots), ("turns", args.turns))
        if v is not None
    }
    spec = attrs.evolve(spec, **changes)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(_LABELS)
    if unknown:
        raise SystemExit(f"agentkv-bench: unknown config(s): {', '.join(sorted(unknown))}")

    def say(message: str) -> None:
        print(f"agentkv-bench: {message}", file=sys.stderr, flush=True)

    async def go() -> dict[str, Any]:
        return await run_benchmark(
            spec,
            out=args.out,
            configs=configs,
            ctx=args.ctx_per_slot,
            tuned_args=args.tuned_args.split(),
            overhead=not args.no_overhead,
            binary=args.llama_server,
            model=args.model,
            say=say,
        )

    report = anyio.run(go)
    print(table(report))
    print(f"\nwritten: {args.out}/benchmarks.json, benchmarks.png, benchmarks.txt")
    print(f"total {report['total_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
