"""The server's log: one line per request, no HTTP chatter, a startup block, JSON on demand.

The session tests run the real ``agentkv-server`` command (a subprocess) in front of the fake
engine served over loopback HTTP, and read what it wrote to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.from_thread
import attrs
import httpx
import pytest
import uvicorn

from agentkv.runtime.engine import free_port
from agentkv.runtime.record import RequestRecord, RequestStatus, request_fields, request_line
from agentkv_server import logs, status
from tests.fakes import FakeLlama

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 32,
    "messages": [{"role": "user", "content": "Say hello."}],
}

#: What must never reach the log at the default level.
CHATTER = re.compile(
    r"HTTP Request|Uvicorn|Started server|Application startup|Waiting for application|"
    r"Shutting down|Finished server|\"(GET|POST) /"
)


@attrs.define
class Diverged(RequestRecord):
    divergence: dict[str, Any] | None = None


@contextmanager
def fake_engine_over_http(fake: FakeLlama) -> Iterator[str]:
    """The fake llama-server on a loopback port (a background event loop); yields its URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            fake.asgi, host="127.0.0.1", port=port, log_level="warning", interface="asgi3"
        )
    )
    with anyio.from_thread.start_blocking_portal() as portal:
        done = portal.start_task_soon(server.serve)
        deadline = time.monotonic() + 30
        while not server.started:
            assert not done.done() and time.monotonic() < deadline, "fake engine did not start"
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            done.result(timeout=30)


@attrs.define
class Ended:
    """What the server wrote to stderr, and its exit status, once it has stopped."""

    stderr: str = ""
    returncode: int | None = None

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


@contextmanager
def agentkv_server(engine_url: str, *args: str, interrupts: int = 1) -> Iterator[tuple[str, Ended]]:
    """``agentkv-server --upstream ENGINE`` as a subprocess; yields its URL and what it leaves
    behind, filled in once it is stopped with Ctrl-C (SIGINT), as a person would (``interrupts``
    times, 50 ms apart)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AGENTKV_API_KEY"}
    command = [sys.executable, "-m", "agentkv_server.cli", "--upstream", engine_url]
    store = [] if "--store-dir" in args else ["--no-store"]
    command += ["--slots", "4", "--port", str(port), *store, *args]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    ended = Ended()
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert process.poll() is None, "agentkv-server exited during startup"
        assert time.monotonic() < deadline, "agentkv-server did not start"
        yield url, ended
    finally:
        for n in range(interrupts):
            if process.poll() is None:
                if n:
                    time.sleep(0.05)
                process.send_signal(signal.SIGINT)
        try:
            ended.stderr = process.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            process.kill()
            ended.stderr = process.communicate()[1]
        ended.returncode = process.returncode


def ten_request_session(url: str) -> None:
    """Ten requests from two agents, streamed and not, with the page and metrics polled."""
    with httpx.Client(base_url=url, timeout=30) as http:
        for n in range(10):
            agent = "coder" if n % 2 else "reviewer"
            messages = [{"role": "user", "content": f"Step {n}: say hello."}]
            body = {**BODY, "messages": messages, "stream": n % 3 == 0}
            r = http.post("/v1/messages", json=body, headers={"x-agent-id": agent})
            assert r.status_code == 200, r.text
            if n % 4 == 0:
                assert http.get("/agentkv/slots").status_code == 200
                assert http.get("/metrics").status_code == 200
                assert http.get("/agentkv/").status_code == 200


def test_a_ten_request_session_logs_ten_lines_and_the_startup_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = FakeLlama(reply="Hello from the fake engine.")
    with fake_engine_over_http(fake) as engine, agentkv_server(engine) as (url, ended):
        ten_request_session(url)
        # The terminal view of the same server.
        assert status.main(["--url", url]) == 0
        shown = capsys.readouterr().out
    assert ended.returncode == 0, ended.stderr
    lines = ended.lines
    requests = [line for line in lines if " request agent=" in line]
    assert len(requests) == 10, "\n".join(lines)
    assert all(re.search(r" INFO agentkv\.runtime: request agent=\w+ ", line) for line in requests)
    assert all("status=ok" in line and "source=" in line for line in requests)
    assert not [line for line in lines if CHATTER.search(line)], "\n".join(lines)
    others = [line for line in lines if " request agent=" not in line]
    assert others[0] == f"agentkv-server: waiting for llama-server at {engine}"
    block = "\n".join(others[1:])
    assert others[1] == "agentkv-server is ready"
    for needed in (
        f"llama-server at {engine}",
        "4 × ? tokens",
        "store    off",
        f"page     {url}/agentkv/",
        f"metrics  {url}/metrics",
        f"export ANTHROPIC_BASE_URL={url}",
        f'base_url = "{url}/v1"',
    ):
        assert needed in block, block
    # Nothing else: the rows, one line per Claude Code variable, the lines of Codex's config.toml
    # (and a few comments).
    assert len(others) <= 45, block
    # The status command saw the server's table.
    assert "slots (4)" in shown and "recent requests" in shown
    assert shown.count("ok") >= 8


def test_a_second_ctrl_c_still_stops_the_runtime_in_order(tmp_path: Path) -> None:
    """Ctrl-C twice (uvicorn's "force quit"): the wait for connections is skipped, but the runtime
    still stops before its engine client closes, so the stop save is made and nothing fails."""
    fake = FakeLlama(reply="Hello from the fake engine.", save_dir=tmp_path)
    args = ("--store-dir", str(tmp_path), "--park-min", "1", "--stop-save", "10")
    with (
        fake_engine_over_http(fake) as engine,
        agentkv_server(engine, *args, interrupts=2) as (url, ended),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        body = {**BODY, "messages": [{"role": "user", "content": "Say hello. " * 40}]}
        r = http.post("/v1/messages", json=body, headers={"x-agent-id": "coder"})
        assert r.status_code == 200, r.text
    assert ended.returncode == 0, ended.stderr
    assert "Traceback" not in ended.stderr
    assert "client has been closed" not in ended.stderr
    # The idle slot's context was saved at the stop.
    assert any(action == "save" for _, action, _ in fake.slot_actions), fake.slot_actions


def test_json_log_format_writes_one_object_per_line() -> None:
    fake = FakeLlama(reply="Hello.")
    with (
        fake_engine_over_http(fake) as engine,
        agentkv_server(engine, "--log-format", "json") as (
            url,
            ended,
        ),
    ):
        ten_request_session(url)
    assert ended.returncode == 0, ended.stderr
    records = [json.loads(line) for line in ended.lines]  # every line is one JSON object
    requests = [r for r in records if "request" in r]
    assert len(requests) == 10
    assert {r["request"]["agent"] for r in requests} == {"coder", "reviewer"}
    assert all(r["request"]["status"] == "ok" and r["level"] == "INFO" for r in requests)
    assert all(r["request"]["prompt_tokens"] > 0 for r in requests)
    (startup,) = [r for r in records if "startup" in r]
    assert startup["startup"]["page"] == f"{url}/agentkv/"
    assert startup["startup"]["metrics"] == f"{url}/metrics"
    assert "ANTHROPIC_BASE_URL" in startup["startup"]["claude_code"]
    assert len(records) <= 13


def test_request_line_says_where_the_prompt_left_the_cache() -> None:
    record = Diverged(
        agent="coder",
        priority=1,
        slot=0,
        source="slot",
        prompt_tokens=12004,
        cached_tokens=5210,
        computed_tokens=6794,
        ttft_s=14.2,
        total_s=20.0,
        status="ok",
        divergence={
            "position": 5210,
            "section": "tool 3 (Bash)",
            "reused": 5210,
            "computed": 6794,
            "seconds": 14.04,
        },
    )
    line = request_line(record)
    assert line.startswith("request agent=coder priority=1 slot=0 source=slot ")
    assert "cached=5210/12004 computed=6794 ttft=14.20s total=20.00s" in line
    assert line.endswith(
        'diverged="token 5210 in tool 3 (Bash): reused 5210, computed 6794, ~14.0 s"'
    )
    assert request_fields(record)["divergence"]["section"] == "tool 3 (Bash)"
    plain = RequestRecord(
        agent="my agent",
        priority=2,
        status=RequestStatus.FAILED,
        error_type="overloaded_error",
    )
    assert request_line(plain) == (
        'request agent="my agent" priority=2 slot=- source=- cached=0/0 computed=0 '
        'ttft=- total=- output=0 status="error: overloaded_error"'
    )
    assert "divergence" not in request_fields(plain)


def test_json_formatter_keeps_the_request_facts_as_data() -> None:
    record = logging.LogRecord("agentkv.runtime", logging.INFO, __file__, 1, "%s", ("x",), None)
    record.agentkv_request = {"agent": "a", "ttft_s": 0.5}
    data = json.loads(logs.JsonFormatter().format(record))
    assert data["message"] == "x" and data["level"] == "INFO"
    assert data["logger"] == "agentkv.runtime"
    assert data["request"] == {"agent": "a", "ttft_s": 0.5}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", data["time"])


def test_engine_http_chatter_is_debug_only() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("info")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert not logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO)
        assert logging.getLogger("agentkv.runtime").isEnabledFor(logging.INFO)
        assert logs.uvicorn_options("info")["access_log"] is False
        logs.configure("debug")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
        assert logs.uvicorn_options("debug")["access_log"] is True
    finally:
        logs.configure("warning")
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        for name in ("httpx", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
            logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_launch_progress_is_written_in_the_log_format(
    fmt: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI hands logs.say to assemble() as its progress callback (device, context plan, pool
    # layout, llama-server's loading lines): in JSON mode those lines are JSON objects too.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(logs, "_format", "text")  # restored after the test
    try:
        logs.configure("info", fmt)
        logs.say("loading the model")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    (line,) = capsys.readouterr().err.splitlines()
    if fmt == "json":
        assert json.loads(line)["message"] == "loading the model"
    else:
        assert line == "agentkv-server: loading the model"
