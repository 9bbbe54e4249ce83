"""The ``real-cli-fanout`` scenario: the real Claude Code CLI's coordinator starts two sub-agents.

A harness proxy in front of each configuration computes the coordinator's first request on the
engine (``max_tokens`` 1) and answers the CLI itself with two foreground ``Agent`` calls, its only
script; the sub-agents and the coordinator's continuation pass unchanged, and llama-server's
``/metrics`` around the continuation gives how much of it was computed
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from agentkv.snapshot import unstructure
from agentkv_bench._runs import by_name, run_claude, scratch, write_run
from agentkv_bench.claude import _env, make_project
from agentkv_bench.engines import NO_PREEMPTION, serve_app, start
from agentkv_bench.metrics import counting, difference, read_counters
from agentkv_bench.report import fmt, render_table
from agentkv_bench.scenarios import Bench, _store
from agentkv_bench.subagents import agent_call, scripted_sse

__all__ = [
    "PROXIED_METHODS",
    "FanoutProxy",
    "FanoutSpec",
    "fanout_table",
    "passed_on",
    "request_kind",
    "run_fanout",
]

CONFIGS = ("llama-server", "agentkv")
_START = {"llama-server": "plain", "agentkv": "agentkv"}
#: The two ``Agent`` calls of the scripted reply: (tool_use id, description, the sub-agent's task).
CALLS = (
    ("toolu_01FANOUTFRONTEND00000000", "Write the front end", "Reply with the single word: front"),
    ("toolu_01FANOUTBACKEND000000000", "Write the back end", "Reply with the single word: back"),
)
PROMPT = "Split the work between two agents"


@attrs.frozen
class FanoutSpec:
    runs: int = 3
    #: One ``claude -p`` session's bound (seconds): a cold ~12K-token prefill takes minutes here.
    timeout: float = 3600.0


#: What a harness proxy forwards.
PROXIED_METHODS = ["GET", "POST", "HEAD", "PUT", "DELETE"]
#: The body is framed again by the proxy's own server.
_FRAMING = frozenset({"content-length", "transfer-encoding", "content-encoding"})


def passed_on(response: httpx.Response) -> dict[str, str]:
    """The upstream response's headers a proxy passes on to its client."""
    return {k: v for k, v in response.headers.items() if k.lower() not in _FRAMING}


def request_kind(headers: Mapping[str, str], body: Any) -> str:
    """Which of a fan-out's requests this is (``headers`` lower-cased): ``subagent``,
    ``coordinator`` (its first request), ``continuation`` or ``other``."""
    if "x-claude-code-agent-id" in headers:
        return "subagent"
    if not isinstance(body, dict) or not any(
        isinstance(tool, dict) and tool.get("name") == "Agent" for tool in body.get("tools") or []
    ):
        return "other"
    messages = body.get("messages") or []
    if any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        return "continuation"
    return "coordinator"


@attrs.define
class Exchange:
    """One request the CLI sent, as the proxy saw it (times from the run's start)."""

    kind: str
    agent: str | None
    started: float
    status: int | None = None
    first_byte: float | None = None
    first_delta: float | None = None
    ended: float | None = None
    #: The stream carried an ``event: error`` (an error the client saw after a 200).
    error_event: bool = False
    #: For the continuation: llama-server's prompt counters around it.
    computed: int | None = None
    cached: int | None = None


@attrs.define
class FanoutProxy:
    """The harness: primes and scripts the coordinator's first request, forwards the rest."""

    upstream: str
    engine_url: str
    #: llama-server's API key (None: it has none).
    engine_key: str | None = None
    origin: float = attrs.field(factory=time.monotonic)
    exchanges: list[Exchange] = attrs.field(factory=list)
    scripted: int = 0

    async def _counters(self, http: httpx.AsyncClient) -> dict[str, float]:
        return await read_counters(http, self.engine_url, self.engine_key)

    def _now(self) -> float:
        return round(time.monotonic() - self.origin, 3)

    def app(self, http: httpx.AsyncClient) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        skip = {"host", "content-length", "accept-encoding"}

        async def forward(request: Request) -> Response:
            body = await request.body()
            headers = {k.lower(): v for k, v in request.headers.items()}
            parsed = json.loads(body) if body and request.url.path == "/v1/messages" else None
            kind = request_kind(headers, parsed) if parsed is not None else "other"
            record = Exchange(kind, headers.get("x-claude-code-agent-id"), self._now())
            self.exchanges.append(record)
            send = {k: v for k, v in request.headers.items() if k.lower() not in skip}
            if kind == "coordinator" and self.scripted == 0 and isinstance(parsed, dict):
                self.scripted += 1
                # Computed on the engine as a real reply would be; the reply itself is scripted.
                primed = json.dumps({**parsed, "max_tokens": 1}).encode()
                async with http.stream(
                    "POST", self.upstream + "/v1/messages", headers=send, content=primed
                ) as response:
                    record.status = response.status_code
                    async for chunk in response.aiter_raw():
                        record.error_event |= b"event: error" in chunk
                record.ended = self._now()
                blocks: list[dict[str, Any]] = [
                    {"type": "text", "text": "I will split the work between two agents."}
                ]
                blocks += [
                    agent_call(call, what, task, background=False) for call, what, task in CALLS
                ]
                return Response(scripted_sse(blocks), media_type="text/event-stream")
            before = await self._counters(http) if kind == "continuation" else None
            upstream = http.build_request(
                request.method,
                self.upstream + request.url.path,
                params=request.query_params,
                headers=send,
                content=body,
            )
            response = await http.send(upstream, stream=True)
            record.status = response.status_code

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_raw():
                        if record.first_byte is None:
                            record.first_byte = self._now()
                        if record.first_delta is None and b"content_block_delta" in chunk:
                            record.first_delta = self._now()
                        record.error_event |= b"event: error" in chunk
                        yield chunk
                finally:
                    await response.aclose()
                    record.ended = self._now()
                    if before is not None:
                        counters = difference(await self._counters(http), before)
                        record.computed = int(counters["prompt_computed"])
                        record.cached = int(counters["prompt_cached"])

            return StreamingResponse(
                relay(), status_code=response.status_code, headers=passed_on(response)
            )

        return Starlette(routes=[Route("/{path:path}", forward, methods=PROXIED_METHODS)])


async def _one(
    bench: Bench, name: str, claude: Path, project: Path, home: Path, spec: FanoutSpec
) -> dict[str, Any]:
    setup = bench.setup
    store_dir = _store(bench, name, fresh=True, tag="real-cli-fanout")
    async with start(setup, _START[name], store_dir=store_dir, config=NO_PREEMPTION) as engine:
        timeout = httpx.Timeout(spec.timeout, connect=10.0)
        async with (
            counting(engine) as counters,
            httpx.AsyncClient(timeout=timeout) as http,
        ):
            proxy = FanoutProxy(engine.url, engine.engine_url, engine.engine_key)
            async with serve_app(proxy.app(http)) as url:
                env = _env(url, home, "coordinator", 0, setup.ctx)
                proxy.origin = started = time.monotonic()
                rc, out, err = await run_claude(
                    [str(claude), "-p", PROMPT], project, env, spec.timeout
                )
                wall = time.monotonic() - started
        tree = None
        if engine.runtime is not None:
            tree = unstructure(engine.runtime.snapshot().tree)
    rows = [attrs.asdict(e) for e in proxy.exchanges]
    continuation = next((e for e in proxy.exchanges if e.kind == "continuation"), None)
    prompt = (continuation.computed or 0) + (continuation.cached or 0) if continuation else 0
    sent = [e for e in proxy.exchanges if e.kind != "other"]
    return {
        "name": name,
        "wall_s": round(wall, 1),
        "rc": rc,
        "answer": out.strip()[:200],
        "stderr": err.strip()[-300:],
        "subagents": len({e.agent for e in proxy.exchanges if e.kind == "subagent"}),
        "errors": sum(1 for e in sent if e.status != 200 or e.error_event),
        "prefill_computed": int(counters["prompt_computed"]),
        "continuation_computed": continuation.computed if continuation else None,
        "continuation_prompt": prompt or None,
        "continuation_fraction": round((continuation.computed or 0) / prompt, 4)
        if continuation and prompt
        else None,
        "continuation_ttft_s": round(continuation.first_delta - continuation.started, 2)
        if continuation and continuation.first_delta is not None
        else None,
        "exchanges": rows,
        "tree": tree,
    }


async def run_fanout(
    bench: Bench, spec: FanoutSpec, *, claude: Path, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """``spec.runs`` runs of every configuration; ``real-cli-fanout.{json,txt}``."""
    for name in configs:
        if name not in CONFIGS:
            raise ValueError(f"unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with scratch("fanout") as root:
        project, home = make_project(root)
        for run in range(1, spec.runs + 1):
            reports = []
            for name in configs:
                bench.say(f"real-cli-fanout run {run}/{spec.runs}: {name}")
                report = await _one(bench, name, claude, project, home, spec)
                bench.say(
                    f"real-cli-fanout run {run}: {name} {report['wall_s']} s, "
                    f"{report['errors']} errors, continuation computed "
                    f"{report['continuation_computed']} of {report['continuation_prompt']}"
                )
                reports.append(report)
            runs.append({"run": run, "configs": reports})
    return await write_run(
        bench, "real-cli-fanout", spec, fanout_table, started, runs=runs, targets=targets(runs)
    )


def targets(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every run beats llama-server alone; the continuation computes under 5 %; no error."""
    beats, under, clean = [], [], []
    for run in runs:
        by = by_name(run["configs"])
        ours, alone = by.get("agentkv"), by.get("llama-server")
        if ours is None:
            continue
        if alone is not None:
            beats.append(ours["wall_s"] < alone["wall_s"])
        fraction = ours["continuation_fraction"]
        under.append(fraction is not None and fraction < 0.05)
        clean.append(ours["errors"] == 0 and ours["rc"] == 0 and ours["subagents"] == 2)
    return {
        "every_run_beats_llama_server": all(beats) if beats else None,
        "continuation_under_5_percent": all(under) if under else None,
        "no_client_error": all(clean) if clean else None,
    }


def fanout_table(result: dict[str, Any]) -> str:
    lines = [
        "Real Claude Code: a coordinator starts two sub-agents (its first reply scripted by the "
        f"harness), {result['slots']} slots, {len(result['runs'])} runs",
        "",
    ]
    for run in result["runs"]:
        configs = run["configs"]
        rows = [
            ("wall time", lambda c: fmt(c["wall_s"], " s")),
            ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
            (
                "continuation computed",
                lambda c: f"{c['continuation_computed']} of {c['continuation_prompt']}",
            ),
            ("continuation first token", lambda c: fmt(c["continuation_ttft_s"], " s")),
            (
                "sub-agents / errors / exit",
                lambda c: f"{c['subagents']} / {c['errors']} / {c['rc']}",
            ),
        ]
        lines.append(f"run {run['run']}")
        lines.append(render_table([{**c, "label": c["name"]} for c in configs], rows))
        lines.append("")
    lines += [f"{k}: {v}" for k, v in result["targets"].items()]
    return "\n".join(lines)
