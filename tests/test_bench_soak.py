"""The soak scenario's own parts, without an engine: the plan, the client, the classifier of
outcomes, the leak counter, the engine's pid and the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest

from agentkv.snapshot import BackgroundRow, QueueRow, unstructure
from agentkv_bench import cli
from agentkv_bench.soak import (
    Exchange,
    Planned,
    SoakSpec,
    anthropic_error,
    classify,
    engine_pids,
    leaked_leases,
    plan_requests,
    send_one,
    server_command,
    soak_table,
    verdict,
)
from tests._snapshot import empty_snapshot, slot_row

OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "restarting"}}


def _event(name: str, **data: Any) -> tuple[str, str]:
    return name, json.dumps({"type": name, **data})


WHOLE_STREAM = (
    _event("message_start", message={"id": "msg_1", "role": "assistant", "content": []}),
    _event("ping"),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi"}),
    _event("content_block_stop", index=0),
    _event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1}),
    _event("message_stop"),
)
WHOLE_MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": "Hi"}],
    "stop_reason": "end_turn",
}


# -- the classifier ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exchange", "outcome", "detail"),
    [
        (Exchange(stream=False, status=200, body=WHOLE_MESSAGE), "ok", ""),
        (Exchange(stream=True, status=200, events=WHOLE_STREAM), "ok", ""),
        (Exchange(stream=False, status=529, body=OVERLOADED), "error", "overloaded_error"),
        (Exchange(stream=True, status=529, body=OVERLOADED), "error", "overloaded_error"),
        (
            Exchange(
                stream=True,
                status=200,
                events=(*WHOLE_STREAM[:4], ("error", json.dumps(OVERLOADED))),
            ),
            "error",
            "overloaded_error",
        ),
        (
            Exchange(stream=True, status=200, events=WHOLE_STREAM[:4], disconnected=True),
            "disconnected",
            "",
        ),
        (Exchange(stream=False, disconnected=True), "disconnected", ""),
        (Exchange(stream=True, status=200, events=WHOLE_STREAM[:2], timed_out=True), "hung", None),
        (Exchange(stream=False, timed_out=True), "hung", None),
    ],
)
def test_whole_answers_errors_drops_and_hangs(
    exchange: Exchange, outcome: str, detail: str | None
) -> None:
    got, words = classify(exchange)
    assert got == outcome
    if detail is not None:
        assert words == detail


@pytest.mark.parametrize(
    ("exchange", "why"),
    [
        # A stream the server cut: no message_stop, no error event.
        (Exchange(stream=True, status=200, events=WHOLE_STREAM[:4]), "without message_stop"),
        (
            Exchange(
                stream=True,
                status=200,
                events=WHOLE_STREAM[:4],
                failure="RemoteProtocolError('peer closed')",
            ),
            "peer closed",
        ),
        (Exchange(stream=True, status=200), "without any event"),
        # An error event, or an error body, that is not Anthropic-shaped.
        (
            Exchange(stream=True, status=200, events=(*WHOLE_STREAM[:2], ("error", "oops"))),
            "not in the Anthropic shape",
        ),
        (
            Exchange(stream=False, status=500, body={"detail": "Internal Server Error"}),
            "without an Anthropic error body",
        ),
        (Exchange(stream=False, status=502, body=None), "without an Anthropic error body"),
        # A 200 that is not a whole message.
        (Exchange(stream=False, status=200, body={"type": "message"}), "without a whole message"),
        (Exchange(stream=False, status=200, body=None), "without a whole message"),
        (Exchange(stream=False, failure="ConnectError('refused')"), "no response"),
        # Events whose data does not match their name.
        (
            Exchange(
                stream=True,
                status=200,
                events=(*WHOLE_STREAM[:-1], ("message_stop", '{"type": "ping"}')),
            ),
            "carries",
        ),
    ],
)
def test_anything_else_is_bad(exchange: Exchange, why: str) -> None:
    outcome, detail = classify(exchange)
    assert outcome == "bad"
    assert why in detail


def test_anthropic_error_shape() -> None:
    assert anthropic_error(OVERLOADED) == "overloaded_error"
    assert anthropic_error({"type": "error", "error": {"type": "api_error"}}) is None
    assert anthropic_error({"type": "error", "error": "boom"}) is None
    assert anthropic_error({"error": {"type": "api_error", "message": "x"}}) is None
    assert anthropic_error("error") is None


# -- the leak counter ------------------------------------------------------------------------


def test_leaked_leases_counts_busy_slots_leases_and_tickets() -> None:
    idle = empty_snapshot(slots=(slot_row(0), slot_row(1)))
    assert leaked_leases(idle) == 0
    held = attrs.evolve(idle, slots=(slot_row(0, busy=True, leases=(7,)), slot_row(1)))
    assert leaked_leases(held) == 2  # as the fuzz test counts: the busy flag and the lease
    ticket = QueueRow(3, "a", 1, 10, 0.5, 0.5, None, None, None)
    queued = attrs.evolve(idle, queue=(ticket,), background=(BackgroundRow(4, "a", 0.5),))
    assert leaked_leases(queued) == 2
    assert leaked_leases(empty_snapshot(slots=(slot_row(0, leases=(1, 2)),))) == 2


# -- the plan ------------------------------------------------------------------------------------


def test_plan_is_fixed_by_the_seed_and_mixes_what_was_asked() -> None:
    spec = SoakSpec(clients=400, requests=3, seed=5)
    plan = plan_requests(spec)
    assert plan == plan_requests(spec)
    assert plan != plan_requests(attrs.evolve(spec, seed=6))
    rows = [p for client in plan for p in client]
    assert len(rows) == 1200
    assert len({p.agent for p in rows}) == 400
    assert all(p.agent == f"soak-{p.client}" for p in rows)
    assert {p.priority for p in rows} == {0, 1, 2, 3}
    assert sum(p.stream for p in rows) == 600
    cut = [p for p in rows if p.cut]
    assert 0.25 < len(cut) / len(rows) < 0.35
    for p in cut:
        if p.stream:
            assert p.cut_after is None and p.cut_events is not None and 0 <= p.cut_events <= 8
        else:
            assert p.cut_events is None and p.cut_after is not None and 0 <= p.cut_after <= 3
    assert {p.cut_events for p in cut if p.stream} >= {0, 8}
    none_cut = plan_requests(attrs.evolve(spec, disconnect=0.0))
    assert not any(p.cut for client in none_cut for p in client)


def test_spec_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        SoakSpec(disconnect=1.5)
    with pytest.raises(ValueError):
        SoakSpec(clients=0)


# -- one request against a scripted server ------------------------------------------------------

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def _sse(events: tuple[tuple[str, str], ...], *, then_stall: bool = False) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        for name, data in events:
            yield f"event: {name}\ndata: {data}\n\n".encode()
        if then_stall:
            await anyio.sleep(3600)

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def _send(handler: Handler, planned: Planned, *, deadline: float = 10.0) -> Exchange:
    seen: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append({"headers": dict(request.headers), "body": json.loads(request.content)})
        return await handler(request)

    async def main() -> Exchange:
        transport = httpx.MockTransport(record)
        async with httpx.AsyncClient(transport=transport) as http:
            return await send_one(
                http, "http://agentkv", planned, api_key="k", max_tokens=32, deadline=deadline
            )

    exchange = anyio.run(main)
    (sent,) = seen
    assert sent["headers"]["x-agent-id"] == planned.agent
    assert sent["headers"]["x-agent-priority"] == str(planned.priority)
    assert sent["body"]["stream"] is planned.stream
    assert sent["body"]["max_tokens"] == 32
    return exchange


def _planned(stream: bool, **cut: Any) -> Planned:
    return Planned(client=1, turn=0, agent="soak-1", priority=1, stream=stream, word="fox", **cut)


def test_a_whole_stream_is_read_to_message_stop() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return _sse(WHOLE_STREAM)

    exchange = _send(handler, _planned(True))
    assert exchange.events == WHOLE_STREAM
    assert classify(exchange) == ("ok", "")


def test_a_stream_is_dropped_after_the_planned_number_of_events() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return _sse(WHOLE_STREAM[:3], then_stall=True)

    exchange = _send(handler, _planned(True, cut_events=2))
    assert exchange.disconnected and len(exchange.events) == 2
    before_first = _send(handler, _planned(True, cut_events=0))
    assert before_first.disconnected and before_first.events == ()


def test_a_stream_the_server_cuts_is_bad_and_one_that_stalls_is_hung() -> None:
    async def cut(request: httpx.Request) -> httpx.Response:
        return _sse(WHOLE_STREAM[:4])

    assert classify(_send(cut, _planned(True)))[0] == "bad"

    async def stall(request: httpx.Request) -> httpx.Response:
        return _sse(WHOLE_STREAM[:2], then_stall=True)

    started = time.monotonic()
    assert classify(_send(stall, _planned(True), deadline=0.3))[0] == "hung"
    assert time.monotonic() - started < 5


def test_a_json_request_is_dropped_after_its_delay_or_answered_before_it() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(3600)
        raise AssertionError("unreachable")

    started = time.monotonic()
    assert classify(_send(slow, _planned(False, cut_after=0.1))) == ("disconnected", "")
    assert time.monotonic() - started < 5

    async def fast(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=WHOLE_MESSAGE)

    assert classify(_send(fast, _planned(False, cut_after=3.0))) == ("ok", "")

    async def refused(request: httpx.Request) -> httpx.Response:
        return httpx.Response(529, json=OVERLOADED)

    assert classify(_send(refused, _planned(False))) == ("error", "overloaded_error")
    assert classify(_send(refused, _planned(True))) == ("error", "overloaded_error")


# -- the server and its engine -------------------------------------------------------------------


def test_server_command_is_what_a_user_types() -> None:
    script = Path("bin/agentkv-server")
    command = server_command(script, port=9123, store_dir=Path("t/store"), slots=2)
    assert command == [str(script), "--port", "9123", "--store-dir", "t/store", "--slots", "2"]
    more = server_command(
        script,
        port=1,
        store_dir=Path("s"),
        slots=3,
        llama_server=Path("b/llama-server"),
        model=Path("m.gguf"),
    )
    assert more[more.index("--llama-server") + 1] == "b/llama-server"
    assert more[more.index("--model") + 1] == "m.gguf"
    assert "--ctx-per-slot" not in more


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_engine_pids_finds_the_llama_server_child(tmp_path: Path) -> None:
    sleep = Path("/bin/sleep")
    fake = tmp_path / "llama-server"
    fake.symlink_to(sleep)
    engine = subprocess.Popen([str(fake), "30"])
    other = subprocess.Popen([str(sleep), "30"])
    try:
        deadline = time.monotonic() + 5
        while engine.pid not in engine_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = engine_pids(os.getpid())
        assert engine.pid in found
        assert other.pid not in found
        assert engine_pids(other.pid) == []
    finally:
        for process in (engine, other):
            process.kill()
            process.wait()


# -- the verdict ----------------------------------------------------------------------------------


def _report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "spec": attrs.asdict(SoakSpec()),
        "clients": 16,
        "requests": 48,
        "planned_disconnects": 14,
        "outcomes": {"ok": 30, "error": 4, "disconnected": 14, "bad": 0, "hung": 0},
        "error_types": {"overloaded_error": 4},
        "bad": [],
        "leaked_leases": 0,
        "settled_s": 0.5,
        "engine_pid": 1234,
        "kill_at_s": 20.0,
        "open_at_kill": 9,
        "engine_back_s": 6.5,
        "engine_restarts": {"before": 0, "after": 1},
        "ok_p50_s": 8.0,
        "ok_p95_s": 30.0,
        "wall_s": 90.0,
    }
    report.update(changes)
    return report


def test_verdict_passes_a_clean_run_and_names_each_failure() -> None:
    assert verdict(_report()) == []
    outcomes = {"ok": 30, "error": 4, "disconnected": 12, "bad": 1, "hung": 1}
    failures = verdict(_report(outcomes=outcomes, leaked_leases=3, engine_back_s=31.0))
    assert len(failures) == 4
    assert any("hung" in f for f in failures)
    assert any("without an answer" in f for f in failures)
    assert any("3 lease" in f for f in failures)
    assert any("31.0 s" in f for f in failures)
    assert verdict(_report(engine_back_s=None)) == ["the engine did not serve again after the kill"]
    assert verdict(_report(engine_pid=None)) == ["no llama-server was found to kill"]
    assert verdict(_report(leaked_leases=-1)) == ["the slot table could not be read after the run"]


def test_summary_states_the_figures() -> None:
    report = _report()
    report["failures"] = verdict(report)
    text = soak_table(report)
    assert "16 clients × 3 requests = 48 requests" in text
    assert "hung: 0    bad: 0    leaked leases: 0" in text
    assert "engine back after 6.5 s" in text
    assert text.endswith("PASS")
    failing = _report(outcomes={"ok": 30, "error": 4, "disconnected": 13, "bad": 0, "hung": 1})
    failing["failures"] = verdict(failing)
    assert soak_table(failing).splitlines()[-1] == "FAIL: 1 hung request(s)"


def test_cli_knows_the_soak_scenario() -> None:
    args = cli.build_parser().parse_args(
        ["--scenario", "soak", "--clients", "5", "--disconnect", "0.5", "--kill-at", "7"]
    )
    assert (args.scenario, args.clients, args.disconnect, args.kill_at) == ("soak", 5, 0.5, 7.0)
    with pytest.raises(SystemExit):
        cli.main(["--scenario", "soak", "--disconnect", "2", "--out", "unused"])


# -- the run's glue, against stand-ins -----------------------------------------------------------

_FAKE_SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.argv[1], "300"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_launched_server_waits_for_health_and_stops_its_whole_group(tmp_path: Path) -> None:
    from agentkv.runtime.engine import free_port
    from agentkv_bench.soak import launched_server

    fake = tmp_path / "llama-server"
    fake.symlink_to("/bin/sleep")
    port = free_port()
    command = [sys.executable, "-c", _FAKE_SERVER, str(fake), str(port)]

    async def main() -> tuple[int, list[int]]:
        url = f"http://127.0.0.1:{port}"
        async with launched_server(command, url, tmp_path / "log" / "server.log") as process:
            async with httpx.AsyncClient() as http:
                assert (await http.get(url + "/health")).status_code == 200
            for _ in range(100):
                if engines := engine_pids(process.pid):
                    return process.pid, engines
                await anyio.sleep(0.05)
            return process.pid, []

    server, engines = anyio.run(main)
    assert len(engines) == 1
    deadline = time.monotonic() + 10
    while not (_gone(server) and _gone(engines[0])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(server) and _gone(engines[0])
    assert (tmp_path / "log" / "server.log").exists()


def _stand_in(engine: subprocess.Popen[bytes], restart_s: float) -> Any:
    """agentkv-server's routes as the soak uses them, on an "engine" that is a child process:
    once that dies, requests get 529 for ``restart_s`` seconds, then it serves again."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {"down_since": None, "open": 0, "restarts": 0}

    def up() -> bool:
        if state["down_since"] is None:
            # A SIGKILL takes a moment to end the process: a bare poll() right after the kill
            # can still see it alive (and the stand-in would serve as if nothing happened).
            try:
                engine.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                return True
            state["down_since"] = time.monotonic()
            state["restarts"] += 1
        return time.monotonic() - state["down_since"] > restart_s

    async def health(request: Request) -> Response:
        body = {"status": "ready" if up() else "engine_restarting"}
        return JSONResponse(
            {**body, "engine_restarts": state["restarts"]}, status_code=200 if up() else 503
        )

    async def messages(request: Request) -> Response:
        body = await request.json()
        if not up():
            return JSONResponse(OVERLOADED, status_code=529)
        if not body["stream"]:
            await anyio.sleep(0.2)
            return JSONResponse(WHOLE_MESSAGE)

        async def events() -> AsyncIterator[bytes]:
            state["open"] += 1
            try:
                for name, data in WHOLE_STREAM:
                    await anyio.sleep(0.05)
                    yield f"event: {name}\ndata: {data}\n\n".encode()
            finally:
                state["open"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def slots(request: Request) -> Response:
        busy = state["open"] > 0
        slot = slot_row(0, busy=busy, leases=(1,) if busy else ())
        return JSONResponse(unstructure(empty_snapshot(slots=(slot,))))

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/agentkv/slots", slots),
        ]
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_a_small_soak_against_a_stand_in_counts_every_request(tmp_path: Path) -> None:
    """The whole run (clients, drops, the kill, the engine's return, the settled table, the
    report) against a stand-in whose engine is a child process named llama-server."""
    from agentkv_bench.engines import serve_app
    from agentkv_bench.soak import drive_soak

    fake = tmp_path / "llama-server"
    fake.symlink_to("/bin/sleep")
    engine = subprocess.Popen([str(fake), "60"])
    spec = SoakSpec(clients=6, requests=4, disconnect=0.4, kill_at=0.6, deadline=5.0, settle=5.0)
    said: list[str] = []
    try:

        async def main() -> dict[str, Any]:
            async with serve_app(_stand_in(engine, restart_s=1.0)) as url:
                return await drive_soak(
                    os.getpid(), url, "k", spec, plan_requests(spec), said.append
                )

        report = anyio.run(main)
    finally:
        engine.kill()
        engine.wait()
    assert report["requests"] == 24 == len(report["per_request"])
    outcomes = report["outcomes"]
    assert sum(outcomes.values()) == 24
    assert outcomes["hung"] == 0 and outcomes["bad"] == 0, report["bad"]
    assert outcomes["ok"] > 0 and outcomes["disconnected"] > 0
    assert report["engine_pid"] == engine.pid and engine.returncode == -9
    assert report["engine_back_s"] is not None and 1.0 <= report["engine_back_s"] < 5
    assert report["engine_restarts"] == {"before": 0, "after": 1}
    assert report["leaked_leases"] == 0
    assert report["open_at_kill"] > 0
    assert verdict(report) == []
    assert any("SIGKILL" in line for line in said)
