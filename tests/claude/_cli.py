"""The real Claude Code CLI against a real ``agentkv-server``, started as a user would start both.

``AgentKVServer`` runs the ``agentkv-server`` console script with its default flags (plus a free
port and a temporary slot directory), reads the shell lines it prints for Claude Code, and stops it
again, together with the llama-server it launched. ``run_claude`` runs ``claude -p`` in a fresh git
project with exactly those lines sourced by bash, under a hard timeout. ``RecordingProxy`` sits
between the two when a test needs to see what Claude Code sent.

Used by the ``claude``-marked tests and by ``tests/claude/tool_task_rate.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from agentkv_bench.fanout import PROXIED_METHODS, passed_on
from agentkv_bench.soak import server_script
from tests._cli_run import run_bounded

#: Where to find the CLI: this variable, else ``claude`` on PATH.
ENV_CLAUDE_BIN = "AGENTKV_CLAUDE_BIN"
#: Extra ``agentkv-server`` flags (for example ``--ctx-per-slot 32768``); empty: its defaults.
ENV_SERVER_ARGS = "AGENTKV_CLAUDE_SERVER_ARGS"
#: The Claude Code version the suite pins (``.ci/run`` installs it).
CLAUDE_CODE_VERSION = "2.1.332"

#: The one line Claude Code 2.1.x always writes to stderr in ``-p`` mode for a model id it does not
#: know. It is a machine-readable diagnostic, not the "doesn't recognize the model" notice, and no
#: setting turns it off short of using an id Claude Code knows (whose window it then cannot be
#: told). Everything else on stderr counts as a warning.
KNOWN_STDERR = re.compile(r"^\[claude-code:unrecognized_model\] \{.*\}$")

_BLOCK_START = "Point Claude Code at it:"
# Variables of the developer's own shell that would change what Claude Code does.
_SCRUB = re.compile(r"^(ANTHROPIC_|CLAUDE_|API_TIMEOUT_MS$|DISABLE_|MAX_THINKING_TOKENS$)")


class ClaudeNotFoundError(RuntimeError):
    """The Claude Code CLI is not installed where the tests look."""


def find_claude() -> Path:
    """The CLI: ``$AGENTKV_CLAUDE_BIN``, else ``claude`` on PATH."""
    explicit = os.environ.get(ENV_CLAUDE_BIN)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ClaudeNotFoundError(f"${ENV_CLAUDE_BIN}={explicit} is not an executable file")
        return path
    found = shutil.which("claude")
    if found is None:
        raise ClaudeNotFoundError(
            f"no `claude` on PATH and ${ENV_CLAUDE_BIN} unset; install it with "
            f"`npm install @anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}`"
        )
    return Path(found)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_env_lines(output: str) -> list[str]:
    """The shell lines ``agentkv-server`` prints after "Point Claude Code at it:"."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.strip().endswith(_BLOCK_START):
            block: list[str] = []
            for candidate in lines[i + 1 :]:
                if not candidate.strip():
                    if block:
                        break
                    continue
                if not candidate.startswith(("export ", "#")):
                    break
                block.append(candidate)
            return block
    raise ValueError(f"no {_BLOCK_START!r} block in the server's output")


def exported(lines: Sequence[str]) -> dict[str, str]:
    """NAME -> value of the ``export`` lines, as bash would set them."""
    script = "\n".join([*lines, "env -0"])
    env = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, check=True, timeout=30
    ).stdout.decode()
    now = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in now.items() if env.get(k) != v}


@attrs.define
class AgentKVServer:
    """``agentkv-server`` as a user starts it: default flags, a free port, a temporary slot dir."""

    root: Path
    extra_args: Sequence[str] = ()
    #: Variables set for the server besides the caller's environment.
    env: Mapping[str, str] = attrs.field(factory=dict)
    startup_timeout: float = 900.0
    port: int = attrs.field(factory=free_port)
    process: subprocess.Popen[bytes] | None = attrs.field(default=None, init=False)
    env_lines: list[str] = attrs.field(factory=list, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "agentkv-server.log"

    @property
    def command(self) -> list[str]:
        return [
            str(server_script()),
            "--port",
            str(self.port),
            "--store-dir",
            str(self.root / "store"),
            *self.extra_args,
        ]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # Its own process group: stopping it also stops the llama-server it launched.
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"agentkv-server exited with {self.process.returncode}:\n{self.log()[-4000:]}"
                )
            with contextlib.suppress(ValueError):
                self.env_lines = parse_env_lines(self.log())
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agentkv-server did not come up:\n{self.log()[-4000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Ctrl-C as a user would, then make sure nothing of its process group is left."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        # Whatever it started (llama-server) shares its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)

    def table(self) -> dict[str, Any]:
        """GET /agentkv/slots."""
        key = exported(self.env_lines).get("ANTHROPIC_API_KEY", "")
        response = httpx.get(f"{self.url}/agentkv/slots", headers={"x-api-key": key}, timeout=30)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def __enter__(self) -> AgentKVServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_project(path: Path) -> Path:
    """A fresh git project with one commit, as a user's new repository would be."""
    path.mkdir(parents=True, exist_ok=True)

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True, timeout=60)

    git("init", "-q", "-b", "main")
    git("config", "user.name", "Demo User")
    git("config", "user.email", "demo@example.com")
    (path / "README.md").write_text("# demo\n")
    git("add", "README.md")
    git("commit", "-q", "-m", "init")
    return path


@attrs.frozen
class ClaudeRun:
    """What one ``claude -p`` run did."""

    stdout: str
    stderr: str
    returncode: int | None
    elapsed: float
    timed_out: bool
    project: Path

    def warnings(self) -> list[str]:
        """Lines on stderr other than the known unrecognised-model diagnostic."""
        return [
            line
            for line in self.stderr.splitlines()
            if line.strip() and not KNOWN_STDERR.match(line.strip())
        ]

    def describe(self) -> str:
        return (
            f"exit {self.returncode} after {self.elapsed:.0f} s"
            f"{' (killed at the timeout)' if self.timed_out else ''}\n"
            f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )


def run_claude(
    env_lines: Sequence[str],
    prompt: str,
    *,
    project: Path,
    home: Path,
    args: Sequence[str] = (),
    timeout: float = 900.0,
    base_url: str | None = None,
    claude: Path | None = None,
) -> ClaudeRun:
    """``claude -p PROMPT`` in ``project`` with the server's lines sourced by bash.

    ``home`` is Claude Code's HOME (its settings and transcripts). ``base_url`` replaces the printed
    ANTHROPIC_BASE_URL (to go through a ``RecordingProxy``). The run is killed after ``timeout``.
    """
    binary = claude or find_claude()
    lines = list(env_lines)
    if base_url is not None:
        lines.append(f"export ANTHROPIC_BASE_URL={base_url}")
    script = "\n".join([*lines, 'exec "$@"'])
    env = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    env["HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    command = ["bash", "-c", script, "bash", str(binary), "-p", prompt, *args]
    ran = run_bounded(command, cwd=project, env=env, timeout=timeout)
    return ClaudeRun(**ran, project=project)


@attrs.define
class Exchange:
    """One request Claude Code sent, as the proxy saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None
    started: float = 0.0
    ended: float | None = None

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def session(self) -> str | None:
        return self.headers.get("x-claude-code-session-id")

    @property
    def retry_count(self) -> int:
        return int(self.headers.get("x-stainless-retry-count", "0") or 0)

    def identity(self) -> str:
        """The request as a computation: its body without ``stream`` (a retry without streaming
        asks for the same thing)."""
        body = self.json()
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k != "stream"}
        return json.dumps(body, sort_keys=True)


#: Answers an exchange itself (an SSE body), or None to pass it on: see ``RecordingProxy.script``.
Script = Callable[[Exchange], bytes | None]


@attrs.define
class RecordingProxy:
    """A pass-through HTTP proxy on a free loopback port that keeps every exchange.

    ``script``, when given, sees each exchange first and may answer it itself with a streamed
    reply: the test harness's way to put Claude Code into a state that the default model cannot
    drive it into (calling its ``Agent`` tool). Everything it does not answer goes upstream.
    """

    upstream: str
    port: int = attrs.field(factory=free_port)
    script: Script | None = None
    exchanges: list[Exchange] = attrs.field(factory=list, init=False)
    _server: Any = attrs.field(default=None, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        client = httpx.AsyncClient(timeout=None)
        skip = {"host", "content-length", "accept-encoding"}

        async def forward(request: Request) -> Response:
            body = await request.body()
            record = Exchange(
                method=request.method,
                path=request.url.path,
                headers={k.lower(): v for k, v in request.headers.items()},
                body=body,
                started=time.monotonic(),
            )
            self.exchanges.append(record)
            scripted = self.script(record) if self.script is not None else None
            if scripted is not None:
                record.status, record.ended = 200, time.monotonic()
                return Response(scripted, media_type="text/event-stream")
            upstream = client.build_request(
                request.method,
                self.upstream + request.url.path,
                params=request.query_params,
                headers={k: v for k, v in request.headers.items() if k.lower() not in skip},
                content=body,
            )
            response = await client.send(upstream, stream=True)
            record.status = response.status_code

            async def relay() -> Any:
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    record.ended = time.monotonic()
                    await response.aclose()

            return StreamingResponse(
                relay(), status_code=response.status_code, headers=passed_on(response)
            )

        return Starlette(routes=[Route("/{path:path}", forward, methods=PROXIED_METHODS)])

    def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="error")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def messages(self, session: str | None = None) -> list[Exchange]:
        """The POST /v1/messages exchanges (of one Claude Code session)."""
        return [
            e
            for e in self.exchanges
            if e.method == "POST"
            and e.path == "/v1/messages"
            and (session is None or e.session == session)
        ]

    def __enter__(self) -> RecordingProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_runs(table: Mapping[str, Any], agent: str) -> list[dict[str, Any]]:
    """The slot table's recent requests of ``agent`` that reached the engine (got a slot)."""
    recent: list[dict[str, Any]] = table.get("recent", [])
    return [r for r in recent if r.get("agent") == agent and r.get("slot") is not None]


@contextlib.contextmanager
def temporary_root(prefix: str = "agentkv-claude-") -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as name:
        yield Path(name)


def server_args_from_env() -> list[str]:
    return shlex.split(os.environ.get(ENV_SERVER_ARGS, ""))
