"""``soak``: agentkv-server under clients that walk away, with its engine killed mid-run.

Clients send short streamed and JSON requests, some dropped on purpose, while the llama-server
that agentkv-server launched gets SIGKILL; every request must end as an answer or an
Anthropic-shaped error and the slot table must settle empty. The run passes with nothing hung or
bad, no lease left and the engine back within ``back_limit`` seconds (docs/reliability.md#soak).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import anyio
import attrs
import httpx
from anyio.abc import Process
from httpx_sse import SSEError, aconnect_sse

from agentkv.runtime.engine import free_port
from agentkv.snapshot import RuntimeSnapshot, structure_snapshot, unstructure
from agentkv_bench.drivers import agent_headers
from agentkv_bench.report import fmt, percentile, rounded, write_report
from agentkv_bench.workload import WORDS

__all__ = [
    "Exchange",
    "Planned",
    "SoakSpec",
    "anthropic_error",
    "classify",
    "drive_soak",
    "engine_pids",
    "launched_server",
    "leaked_leases",
    "plan_requests",
    "run_soak",
    "send_one",
    "server_command",
    "soak_table",
    "verdict",
]

Say = Callable[[str], None]
Outcome = Literal["ok", "error", "disconnected", "bad", "hung"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

#: The events that end an Anthropic stream.
_TERMINAL = ("message_stop", "error")


_at_least_1 = attrs.validators.ge(1)
_not_negative = attrs.validators.ge(0.0)


@attrs.frozen
class SoakSpec:
    clients: int = attrs.field(default=16, validator=_at_least_1)
    #: Requests per client, one after another.
    requests: int = attrs.field(default=3, validator=_at_least_1)
    #: The share of requests dropped on purpose.
    disconnect: float = attrs.field(
        default=0.3, validator=[_not_negative, attrs.validators.le(1.0)]
    )
    #: Seconds from the clients' start to the engine's SIGKILL.
    kill_at: float = attrs.field(default=20.0, validator=_not_negative)
    slots: int = attrs.field(default=2, validator=_at_least_1)
    max_tokens: int = 32
    #: A request still open this many seconds after it was sent is hung.
    deadline: float = 300.0
    #: The engine must serve again within this many seconds of the kill.
    back_limit: float = 30.0
    #: How long the slot table may take to empty once every client is done.
    settle: float = 30.0
    seed: int = 1

    @classmethod
    def quick(cls, seed: int = 1) -> SoakSpec:
        return cls(clients=4, requests=2, kill_at=10.0, seed=seed)


# -- the plan: what each client sends, and when it walks away ------------------------------------


@attrs.frozen
class Planned:
    """One request of the plan. ``cut_events``: a stream is dropped after that many events (0:
    before the first); ``cut_after``: a JSON request is dropped after that many seconds."""

    client: int
    turn: int
    agent: str
    priority: int
    stream: bool
    word: str
    cut_events: int | None = None
    cut_after: float | None = None

    @property
    def cut(self) -> bool:
        return self.cut_events is not None or self.cut_after is not None

    def body(self, max_tokens: int) -> dict[str, Any]:
        return {
            "model": "agentkv-local",
            "max_tokens": max_tokens,
            "stream": self.stream,
            "messages": [
                {"role": "user", "content": f"Write one short sentence about a {self.word}."}
            ],
        }


def plan_requests(spec: SoakSpec) -> list[list[Planned]]:
    """Every client's requests, fixed by ``spec.seed``: streamed and JSON alternate (by client
    and turn), priorities go round 0–3, and each request is dropped with probability
    ``spec.disconnect``."""
    rng = random.Random(spec.seed)

    def planned(client: int, turn: int) -> Planned:
        stream = (client + turn) % 2 == 0
        cut = rng.random() < spec.disconnect
        return Planned(
            client=client,
            turn=turn,
            agent=f"soak-{client}",
            priority=client % 4,
            stream=stream,
            word=WORDS[(client * spec.requests + turn) % len(WORDS)],
            cut_events=rng.randint(0, 8) if cut and stream else None,
            cut_after=round(rng.uniform(0.0, 3.0), 3) if cut and not stream else None,
        )

    return [[planned(c, t) for t in range(spec.requests)] for c in range(spec.clients)]


# -- what a client saw, and what it counts as --------------------------------------------------


@attrs.frozen
class Exchange:
    """What the client saw of one request. ``events``: (event name, data) of a stream, as
    received; ``body``: the parsed JSON body of a non-stream answer (or of an HTTP error),
    None when there was none or it was not JSON; ``failure``: the transport error that ended it."""

    stream: bool
    status: int | None = None
    body: Any = None
    events: tuple[tuple[str, str], ...] = ()
    disconnected: bool = False
    timed_out: bool = False
    failure: str | None = None


def anthropic_error(body: Any) -> str | None:
    """The error type of an Anthropic-shaped error body, None for anything else."""
    if not isinstance(body, Mapping) or body.get("type") != "error":
        return None
    error = body.get("error")
    if not isinstance(error, Mapping):
        return None
    kind, message = error.get("type"), error.get("message")
    if not isinstance(kind, str) or not kind or not isinstance(message, str):
        return None
    return kind


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _whole_message(body: Any) -> bool:
    return (
        isinstance(body, Mapping)
        and body.get("type") == "message"
        and body.get("role") == "assistant"
        and isinstance(body.get("content"), list)
        and body.get("stop_reason") is not None
    )


def _classify_stream(events: Sequence[tuple[str, str]]) -> tuple[Outcome, str]:
    names = [name for name, _ in events]
    for name, data in events:
        if name == "error":
            kind = anthropic_error(_json(data))
            if kind is None:
                return "bad", f"error event not in the Anthropic shape: {data[:200]}"
            return "error", kind
    if not names:
        return "bad", "stream ended without any event"
    if names[0] != "message_start":
        return "bad", f"stream began with {names[0]!r}, not message_start"
    if names[-1] != "message_stop":
        return "bad", f"stream ended after {names[-1]!r} without message_stop or error"
    for name, data in events:
        payload = _json(data)
        if not isinstance(payload, Mapping) or payload.get("type") != name:
            return "bad", f"event {name!r} carries {data[:200]!r}"
    return "ok", ""


def classify(exchange: Exchange) -> tuple[Outcome, str]:
    """The request's outcome, and in words what it was (the error type, or what was wrong)."""
    if exchange.timed_out:
        return "hung", "still open at the deadline"
    if exchange.disconnected:
        return "disconnected", ""
    if exchange.status is None:
        return "bad", f"no response: {exchange.failure or 'nothing received'}"
    if exchange.status >= 400:
        kind = anthropic_error(exchange.body)
        if kind is None:
            return "bad", f"HTTP {exchange.status} without an Anthropic error body"
        return "error", kind
    if exchange.status != 200:
        return "bad", f"HTTP {exchange.status}"
    if exchange.stream:
        outcome, detail = _classify_stream(exchange.events)
        if outcome == "bad" and exchange.failure is not None:
            detail = f"{detail} ({exchange.failure})"
        return outcome, detail
    if exchange.failure is not None:
        return "bad", f"body cut: {exchange.failure}"
    if not _whole_message(exchange.body):
        return "bad", "HTTP 200 without a whole message"
    return "ok", ""


def leaked_leases(snapshot: RuntimeSnapshot) -> int:
    """What an idle server must not hold: busy slots and their leases (counted as the fuzz test
    counts them), queued and background tickets."""
    held = sum(int(s.busy) + len(s.leases) for s in snapshot.slots)
    return held + len(snapshot.queue) + len(snapshot.background)


# -- one request --------------------------------------------------------------------------------


async def _stream_request(
    http: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    cut_events: int | None,
) -> Exchange:
    # Raw SSE: the verdict checks event names against their data, which the SDK does not expose.
    events: list[tuple[str, str]] = []
    status: int | None = None
    try:
        async with aconnect_sse(http, "POST", url, json=body, headers=dict(headers)) as source:
            response = source.response
            status = response.status_code
            if status != 200:
                await response.aread()
                return Exchange(stream=True, status=status, body=_json(response.text))
            if cut_events == 0:
                return Exchange(stream=True, status=status, disconnected=True)
            async for sse in source.aiter_sse():
                events.append((sse.event, sse.data))
                if sse.event in _TERMINAL:
                    break
                if cut_events is not None and len(events) >= cut_events:
                    return Exchange(
                        stream=True, status=status, events=tuple(events), disconnected=True
                    )
    except (httpx.HTTPError, SSEError) as exc:
        return Exchange(stream=True, status=status, events=tuple(events), failure=repr(exc))
    return Exchange(stream=True, status=status, events=tuple(events))


async def send_one(
    http: httpx.AsyncClient,
    base_url: str,
    planned: Planned,
    *,
    api_key: str,
    max_tokens: int,
    deadline: float,
) -> Exchange:
    """Send one planned request, drop it when the plan says so, give up on it at ``deadline``."""
    url = base_url + "/v1/messages"
    body = planned.body(max_tokens)
    headers = agent_headers(planned.agent, planned.priority, api_key)
    with anyio.move_on_after(deadline) as limit:
        if planned.stream:
            return await _stream_request(http, url, body, headers, planned.cut_events)
        with anyio.move_on_after(planned.cut_after) as cut:
            try:
                response = await http.post(url, json=body, headers=headers)
            except httpx.HTTPError as exc:
                return Exchange(stream=False, failure=repr(exc))
            return Exchange(stream=False, status=response.status_code, body=_json(response.text))
        if cut.cancelled_caught:
            return Exchange(stream=False, disconnected=True)
    assert limit.cancelled_caught
    return Exchange(stream=planned.stream, timed_out=True)


# -- the server and its engine -----------------------------------------------------------------


def server_script() -> Path:
    """The ``agentkv-server`` console script of this environment."""
    beside = Path(sys.executable).with_name("agentkv-server")
    if beside.is_file():
        return beside
    found = shutil.which("agentkv-server")
    if found is None:
        raise SystemExit("agentkv-bench: no agentkv-server script; pip install -e '.[all]'")
    return Path(found)


def server_command(
    script: Path,
    *,
    port: int,
    store_dir: Path,
    slots: int,
    llama_server: Path | None = None,
    model: Path | None = None,
    ctx_per_slot: int | None = None,
) -> list[str]:
    """``agentkv-server`` as a user starts it, on ``port`` with its store in ``store_dir``."""
    command = [str(script), "--port", str(port), "--store-dir", str(store_dir)]
    command += ["--slots", str(slots)]
    given = {"--llama-server": llama_server, "--model": model, "--ctx-per-slot": ctx_per_slot}
    for flag, value in given.items():
        if value is not None:
            command += [flag, str(value)]
    return command


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in children.read_text().split()]
    return found


def _argv0(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def engine_pids(root: int) -> list[int]:
    """The llama-server processes below ``root``: its descendants whose program is named
    ``llama-server…``."""
    found: list[int] = []
    queue = _children(root)
    seen: set[int] = set()
    while queue:
        pid = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        if "llama-server" in Path(_argv0(pid)).name:
            found.append(pid)
        queue += _children(pid)
    return found


@contextlib.asynccontextmanager
async def launched_server(
    command: Sequence[str], url: str, log_path: Path, *, startup_timeout: float = 900.0
) -> AsyncIterator[Process]:
    """Run ``command`` in its own process group until ``GET {url}/health`` is 200; on the way
    out SIGTERM the group, then SIGKILL what is left of it after a grace period."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = await anyio.open_process(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            with anyio.move_on_after(startup_timeout) as waiting:
                while not await _healthy(http, url):
                    if process.returncode is not None:
                        raise SystemExit(
                            f"agentkv-bench: agentkv-server exited with {process.returncode}; "
                            f"see {log_path}"
                        )
                    await anyio.sleep(0.5)
        if waiting.cancelled_caught:
            raise SystemExit(
                f"agentkv-bench: agentkv-server did not answer /health within "
                f"{startup_timeout:.0f} s; see {log_path}"
            )
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            await _stop_group(process)


async def _stop_group(process: Process, grace: float = 30.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with anyio.move_on_after(grace):
        await process.wait()
    # Whatever is left of the group (the llama-server it launched) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with anyio.move_on_after(10):
        await process.wait()


async def _healthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def _health(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        body = (await http.get(url + "/health")).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


async def _engine_back(
    http: httpx.AsyncClient, url: str, api_key: str, killed: float, limit: float
) -> float | None:
    """Seconds from ``killed`` (monotonic) until ``/health`` is 200 and a small request gets a
    whole answer; None if that did not happen within ``limit`` seconds."""
    small = Planned(client=-1, turn=0, agent="soak-probe", priority=0, stream=False, word="probe")
    with anyio.move_on_after(max(0.0, killed + limit - time.monotonic())):
        while True:
            if await _healthy(http, url):
                exchange = await send_one(
                    http, url, small, api_key=api_key, max_tokens=4, deadline=limit
                )
                if classify(exchange)[0] == "ok":
                    return time.monotonic() - killed
            await anyio.sleep(0.25)
    return None


@attrs.frozen
class _Kill:
    pid: int | None
    at_s: float | None
    open_requests: int
    engine_back_s: float | None


# -- the run ----------------------------------------------------------------------------------


@attrs.frozen
class _Result:
    planned: Planned
    started: float
    seconds: float
    outcome: Outcome
    detail: str


def verdict(report: Mapping[str, Any]) -> list[str]:
    """What failed, in words; empty when the run passes."""
    failures: list[str] = []
    outcomes = report["outcomes"]
    if outcomes.get("hung"):
        failures.append(f"{outcomes['hung']} hung request(s)")
    if outcomes.get("bad"):
        failures.append(f"{outcomes['bad']} request(s) ended without an answer or an error")
    if report["leaked_leases"] < 0:
        failures.append("the slot table could not be read after the run")
    elif report["leaked_leases"]:
        failures.append(f"{report['leaked_leases']} lease(s) or ticket(s) left after the run")
    if report["engine_pid"] is None:
        failures.append("no llama-server was found to kill")
    elif report["engine_back_s"] is None:
        failures.append("the engine did not serve again after the kill")
    elif report["engine_back_s"] > report["spec"]["back_limit"]:
        failures.append(
            f"the engine served again only {report['engine_back_s']} s after the kill "
            f"(limit {report['spec']['back_limit']} s)"
        )
    return failures


async def run_soak(
    out: Path,
    spec: SoakSpec,
    *,
    llama_server: Path | None = None,
    model: Path | None = None,
    ctx_per_slot: int | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """The soak run; ``soak.{json,txt}`` under ``out``, the server's log under ``out/logs``."""
    api_key = os.environ.get("AGENTKV_API_KEY") or "bench"
    plan = plan_requests(spec)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out / "logs" / "soak-agentkv-server.log"
    with tempfile.TemporaryDirectory(prefix="agentkv-soak-") as tmp:
        command = server_command(
            server_script(),
            port=port,
            store_dir=Path(tmp) / "store",
            slots=spec.slots,
            llama_server=llama_server,
            model=model,
            ctx_per_slot=ctx_per_slot,
        )
        say(f"soak: starting agentkv-server on port {port} (log: {log_path})")
        async with launched_server(command, url, log_path) as process:
            report = await drive_soak(process.pid, url, api_key, spec, plan, say)
    report["server_log"] = str(log_path)
    report["failures"] = verdict(report)
    report["passed"] = not report["failures"]
    await write_report(report, soak_table(report), out, stem="soak")
    return report


async def drive_soak(
    server_pid: int, url: str, api_key: str, spec: SoakSpec, plan: list[list[Planned]], say: Say
) -> dict[str, Any]:
    """Run the plan against the server at ``url`` (process ``server_pid``, whose llama-server
    child is killed), then read its settled slot table; the report without its verdict."""
    results: list[_Result] = []
    open_now = [0]
    kill = _Kill(None, None, 0, None)
    limits = httpx.Limits(max_connections=spec.clients + 8, max_keepalive_connections=0)
    # No read timeout of httpx's own: a request's only limit is the deadline, which makes it hung.
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        restarts_before = (await _health(http, url)).get("engine_restarts")
        began = time.monotonic()

        async def client(rows: list[Planned]) -> None:
            for planned in rows:
                started = time.monotonic()
                open_now[0] += 1
                try:
                    exchange = await send_one(
                        http,
                        url,
                        planned,
                        api_key=api_key,
                        max_tokens=spec.max_tokens,
                        deadline=spec.deadline,
                    )
                finally:
                    open_now[0] -= 1
                seconds = time.monotonic() - started
                results.append(_Result(planned, started - began, seconds, *classify(exchange)))

        async def killer() -> None:
            nonlocal kill
            await anyio.sleep(spec.kill_at)
            pids = engine_pids(server_pid)
            if not pids:
                say("soak: no llama-server below agentkv-server to kill")
                return
            pid, opened = pids[0], open_now[0]
            killed = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            say(f"soak: SIGKILL llama-server {pid} at {killed - began:.1f} s, {opened} open")
            back = await _engine_back(http, url, api_key, killed, limit=max(120.0, spec.back_limit))
            say(f"soak: engine back after {fmt(back, ' s')}")
            kill = _Kill(pid, round(killed - began, 2), opened, rounded(back, 2))

        say(f"soak: {spec.clients} clients × {spec.requests} requests")
        async with anyio.create_task_group() as tg:
            tg.start_soon(killer)
            for rows in plan:
                tg.start_soon(client, rows)
        # Until the last client's last request ended (the kill's probe may run longer).
        wall = max((r.started + r.seconds for r in results), default=0.0)

        # The server may still be finishing a dropped request: give it a while to settle.
        settle_started = time.monotonic()
        snapshot: RuntimeSnapshot | None = None
        leaked: int | None = None
        with anyio.move_on_after(spec.settle):
            while True:
                # A snapshot of another shape (SnapshotShapeError, another agentkv) cannot be
                # read: it counts as leaking, like no answer at all.
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    response = await http.get(
                        url + "/agentkv/slots", headers={"x-api-key": api_key}
                    )
                    if response.status_code == 200:
                        snapshot = structure_snapshot(response.json())
                        leaked = leaked_leases(snapshot)
                        if leaked == 0:
                            break
                await anyio.sleep(0.5)
        settled_s = time.monotonic() - settle_started
        restarts_after = (await _health(http, url)).get("engine_restarts")
    outcomes = Counter(r.outcome for r in results)
    ok_times = [r.seconds for r in results if r.outcome == "ok"]
    errors = Counter(r.detail for r in results if r.outcome == "error")
    return {
        "scenario": "soak",
        "spec": attrs.asdict(spec),
        "clients": spec.clients,
        "requests": len(results),
        "planned_disconnects": sum(r.planned.cut for r in results),
        "outcomes": {name: outcomes.get(name, 0) for name in OUTCOMES},
        "error_types": dict(errors.most_common()),
        "bad": [
            {"agent": r.planned.agent, "turn": r.planned.turn, "detail": r.detail}
            for r in results
            if r.outcome == "bad"
        ],
        # None: the slot table could not be read at all, which counts as leaking.
        "leaked_leases": leaked if leaked is not None else -1,
        "settled_s": round(settled_s, 2),
        "engine_pid": kill.pid,
        "kill_at_s": kill.at_s,
        "open_at_kill": kill.open_requests,
        "engine_back_s": kill.engine_back_s,
        "engine_restarts": {"before": restarts_before, "after": restarts_after},
        "ok_p50_s": rounded(percentile(ok_times, 0.5), 2),
        "ok_p95_s": rounded(percentile(ok_times, 0.95), 2),
        "wall_s": round(wall, 2),
        "total_s": round(wall + settled_s, 1),
        "slots_after": unstructure(snapshot.slots) if snapshot is not None else None,
        "per_request": [
            {
                "agent": r.planned.agent,
                "turn": r.planned.turn,
                "priority": r.planned.priority,
                "stream": r.planned.stream,
                "cut_events": r.planned.cut_events,
                "cut_after_s": r.planned.cut_after,
                "started_s": round(r.started, 3),
                "seconds": round(r.seconds, 3),
                "outcome": r.outcome,
                "detail": r.detail,
            }
            for r in sorted(results, key=lambda r: r.started)
        ],
    }


def soak_table(report: Mapping[str, Any]) -> str:
    """The summary the run prints."""
    spec = report["spec"]
    outcomes = report["outcomes"]
    errors = ", ".join(f"{k} {v}" for k, v in report["error_types"].items()) or "none"
    lines = [
        f"soak: {report['clients']} clients × {spec['requests']} requests = "
        f"{report['requests']} requests on {spec['slots']} slots, "
        f"{report['planned_disconnects']} planned disconnects (p = {spec['disconnect']})",
        "outcomes: " + ", ".join(f"{name} {outcomes[name]}" for name in OUTCOMES),
        f"error types: {errors}",
        f"hung: {outcomes['hung']}    bad: {outcomes['bad']}    "
        f"leaked leases: {report['leaked_leases']} (settled in {report['settled_s']} s)",
        f"engine SIGKILL at {fmt(report['kill_at_s'], ' s')} with {report['open_at_kill']} "
        f"requests open; engine back after {fmt(report['engine_back_s'], ' s')} "
        f"(limit {spec['back_limit']} s); restarts {report['engine_restarts']['before']} → "
        f"{report['engine_restarts']['after']}",
        f"ok requests: p50 {fmt(report['ok_p50_s'], ' s')}, p95 {fmt(report['ok_p95_s'], ' s')}; "
        f"wall time {fmt(report['wall_s'], ' s')}",
    ]
    if report["engine_pid"] is not None and not report["open_at_kill"]:
        lines.append("note: no request was open at the kill; lower --kill-at or raise --requests")
    lines += [f"  bad: {row['agent']} turn {row['turn']}: {row['detail']}" for row in report["bad"]]
    failures = report.get("failures")
    if failures is not None:
        lines.append("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return "\n".join(lines)
