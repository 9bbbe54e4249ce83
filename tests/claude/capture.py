"""Capture what the real Claude Code CLI sends first, without a model.

``CannedServer`` is a small Messages API on a free loopback port: it keeps every request body and
answers each with a fixed, minimal SSE reply (one text block). With ``agent_call`` set it answers
the first request of a session instead with one ``Agent`` tool call, so the CLI starts a sub-agent
whose own first request is captured as well. A ``claude -p`` run against it takes seconds.

``python -m tests.claude.capture OUT`` runs the CLI (``$AGENTKV_CLAUDE_BIN``) in several working
directories (a git repository, another one, a plain directory, another HOME and user, another
shell) and writes each first request, and a sub-agent's, to ``OUT/<case>.json`` with the scratch
paths written as neutral ones (:func:`sanitise`): the material for measuring what of Claude
Code's prompt depends on the project (docs/claude-code.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

from tests.claude._cli import CLAUDE_CODE_VERSION, find_claude, make_project

#: The lines ``agentkv-server`` prints for Claude Code, with the base URL filled in per run.
CLIENT_ENV = {
    "ANTHROPIC_API_KEY": "agentkv",
    "ANTHROPIC_MODEL": "agentkv-local",
    "ANTHROPIC_DEFAULT_OPUS_MODEL": "agentkv-local",
    "ANTHROPIC_DEFAULT_SONNET_MODEL": "agentkv-local",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL": "agentkv-local",
    "ANTHROPIC_DEFAULT_FABLE_MODEL": "agentkv-local",
    "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "API_TIMEOUT_MS": "1800000",
    "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
    "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
}

#: A sub-agent's first request starts its system prompt with this billing-line field.
SUBAGENT_MARK = "cc_is_subagent=true"


def _sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def canned_reply(model: str, *, text: str = "ok", call: Mapping[str, Any] | None = None) -> bytes:
    """A complete Messages SSE stream: one text block, or one ``tool_use`` block for ``call``."""
    message: dict[str, Any] = {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    frames = [_sse("message_start", {"type": "message_start", "message": message})]
    if call is None:
        block: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": text}
        stop = "end_turn"
    else:
        block = {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": call["name"]}
        block["input"] = {}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call["input"])}
        stop = "tool_use"
    frames += [
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(frames)


@attrs.define
class Captured:
    """One request the CLI sent."""

    path: str
    headers: dict[str, str]
    body: Any

    @property
    def is_subagent(self) -> bool:
        system = self.body.get("system") if isinstance(self.body, dict) else None
        first = system[0].get("text", "") if isinstance(system, list) and system else ""
        return SUBAGENT_MARK in first


@attrs.define
class CannedServer:
    """A Messages API that records every request and answers with a canned reply.

    ``agent_call``: the input of an ``Agent`` tool call to answer a session's first request with
    (the CLI then runs that sub-agent, whose requests get the plain reply).
    """

    agent_call: Mapping[str, Any] | None = None
    requests: list[Captured] = attrs.field(factory=list, init=False)
    _server: ThreadingHTTPServer | None = attrs.field(default=None, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _called: set[str] = attrs.field(factory=set, init=False)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _answer(self, captured: Captured) -> tuple[int, str, bytes]:
        if not captured.path.startswith("/v1/messages"):
            return 404, "application/json", b'{"type":"error","error":{"type":"not_found_error"}}'
        body = captured.body if isinstance(captured.body, dict) else {}
        model = str(body.get("model", "agentkv-local"))
        if captured.path.startswith("/v1/messages/count_tokens"):
            return 200, "application/json", b'{"input_tokens":1}'
        session = captured.headers.get("x-claude-code-session-id", "")
        call = None
        with self._lock:
            first = session not in self._called
            if self.agent_call is not None and not captured.is_subagent and first:
                self._called.add(session)
                call = {"name": "Agent", "input": dict(self.agent_call)}
        return 200, "text/event-stream", canned_reply(model, call=call)

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                captured = Captured(
                    path=path, headers={k.lower(): v for k, v in self.headers.items()}, body=body
                )
                with owner._lock:
                    owner.requests.append(captured)
                status, kind, payload = owner._answer(captured)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_POST = do_GET = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def messages(self) -> list[Captured]:
        """The ``POST /v1/messages`` requests, in arrival order."""
        with self._lock:
            return [c for c in self.requests if c.path == "/v1/messages"]

    def __enter__(self) -> CannedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client_env(base_url: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment ``claude -p`` runs with: the printed lines, ``home``, nothing of the
    developer's own Claude Code settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "CLAUDE_")) and k != "API_TIMEOUT_MS"
    }
    env.update(CLIENT_ENV)
    env["ANTHROPIC_BASE_URL"] = base_url
    env["HOME"] = str(home)
    env.update(extra)
    home.mkdir(parents=True, exist_ok=True)
    return env


def capture(
    server: CannedServer,
    prompt: str,
    *,
    project: Path,
    home: Path,
    claude: Path | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Captured]:
    """Run ``claude -p PROMPT`` in ``project`` against ``server``; the messages it sent."""
    before = len(server.messages())
    binary = claude or find_claude()
    subprocess.run(
        [str(binary), "-p", prompt],
        cwd=project,
        env=client_env(server.url, home, **(env or {})),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return server.messages()[before:]


def capture_interactive(
    server: CannedServer,
    prompt: str,
    *,
    project: Path,
    home: Path,
    claude: Path | None = None,
    timeout: float = 60.0,
) -> list[Captured]:
    """Type ``prompt`` into the interactive CLI (under tmux) in ``project``; the messages it sent.

    ``home``'s ``.claude.json`` is set up the way a user's would be after the first start
    (onboarding done, the project trusted, the API key approved), so no dialog stands between.
    """
    binary = claude or find_claude()
    config_path = home / ".claude.json"
    home.mkdir(parents=True, exist_ok=True)
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["hasCompletedOnboarding"] = True
    config.setdefault("projects", {})[str(project)] = {"hasTrustDialogAccepted": True}
    key = CLIENT_ENV["ANTHROPIC_API_KEY"]
    config["customApiKeyResponses"] = {"approved": [key[-20:]], "rejected": []}
    config_path.write_text(json.dumps(config))
    env = client_env(server.url, home)
    session = "agentkv-capture-" + secrets.token_hex(4)
    before = len(server.messages())
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", str(binary)],
        cwd=project,
        env=env,
        check=True,
        timeout=30,
    )
    try:
        deadline = time.monotonic() + timeout
        typed = False
        while time.monotonic() < deadline and len(server.messages()) == before:
            time.sleep(0.5)
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if not typed and "❯" in screen:  # the input prompt is up
                subprocess.run([*tmux, "send-keys", "-t", session, "-l", prompt], check=True)
                time.sleep(0.5)
                subprocess.run([*tmux, "send-keys", "-t", session, "Enter"], check=True)
                typed = True
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)
    return server.messages()[before:]


#: The cases ``main`` captures: name -> (project directory, or None for the first git project
#: without a commit of its own; git or not; HOME's user name; extra environment).
CASES: dict[str, tuple[str, bool, str, dict[str, str]]] = {
    "git_demo": ("demo", True, "demo", {}),
    "git_other": ("other", True, "demo", {}),
    "plain_dir": ("notes", False, "demo", {}),
    "other_user": ("demo", True, "alice", {"USER": "alice", "LOGNAME": "alice"}),
    "other_shell": ("demo", True, "demo", {"SHELL": "/bin/zsh"}),
}
#: The cases run again in the interactive CLI (with ``--interactive``; it needs tmux).
INTERACTIVE_CASES = ("git_demo", "git_other")
#: The cases run again with a sub-agent (the first request a sub-agent sends).
SUBAGENT_CASES = ("git_demo", "git_other")
#: The sub-agent they ask for.
AGENT_CALL = {
    "description": "Answer one word",
    "prompt": "Reply with the single word: sub",
    "subagent_type": "general-purpose",
    "run_in_background": False,
}


#: Request headers the fixtures leave out (they say nothing about the client).
_UNRECORDED = {"host", "content-length", "connection"}


def dashed(path: str) -> str:
    """A path as Claude Code names its project directory: every ``/`` and ``.`` a ``-``."""
    return path.replace("/", "-").replace(".", "-")


def sanitise(text: str, root: Path) -> str:
    """Captured text with the scratch root written as the neutral paths of the fixtures:
    projects ``/tmp/agentkv-<name>``, homes ``/home/<user>``; the device id zeroed."""
    base = str(root)
    text = text.replace(f"{base}/home/", "/home/")
    text = text.replace(dashed(f"{base}/home/"), "-home-")
    text = text.replace(f"{base}/", "/tmp/agentkv-")
    text = text.replace(dashed(f"{base}/"), "-tmp-agentkv-")
    return re.sub(r'(\\"device_id\\":\\")[0-9a-f]{64}', lambda m: m.group(1) + "0" * 64, text)


def _project(root: Path, name: str, git: bool) -> Path:
    path = root / name
    if path.exists():
        return path
    if git:
        return make_project(path)
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("notes\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for <case>.json")
    parser.add_argument("--prompt", default="Reply with the single word: alpha")
    parser.add_argument(
        "--interactive", action="store_true", help="also capture the interactive CLI (tmux)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    claude = find_claude()
    with tempfile.TemporaryDirectory(prefix="agentkv-capture-") as name:
        root = Path(name)
        for mode in ("p", "subagent", "interactive"):
            if mode == "interactive" and not args.interactive:
                continue
            agent = mode == "subagent"
            with CannedServer(agent_call=AGENT_CALL if agent else None) as server:
                for case, (dirname, git, user, env) in CASES.items():
                    if mode != "p" and case not in (SUBAGENT_CASES if agent else INTERACTIVE_CASES):
                        continue
                    prefix = "" if mode == "p" else "sub-" if agent else "tty-"
                    project = _project(root, prefix + dirname, git)
                    home = root / "home" / user
                    start = time.monotonic()
                    if mode == "interactive":
                        sent = capture_interactive(
                            server, args.prompt, project=project, home=home, claude=claude
                        )
                    else:
                        sent = capture(
                            server, args.prompt, project=project, home=home, claude=claude, env=env
                        )
                    wanted = [c for c in sent if c.is_subagent] if agent else sent[:1]
                    label = case if mode == "p" else f"{'subagent' if agent else mode}_{case}"
                    if not wanted:
                        print(f"{label}: nothing captured", file=sys.stderr)
                        continue
                    headers = {k: v for k, v in wanted[0].headers.items() if k not in _UNRECORDED}
                    record = {
                        "claude_code": CLAUDE_CODE_VERSION,
                        "command": (
                            f"claude, then typed: {args.prompt}"
                            if mode == "interactive"
                            else f"claude -p {args.prompt!r}"
                        ),
                        "cwd": str(project),
                        "home": str(home),
                        "env": env,
                        "method": "POST",
                        "path": "/v1/messages",
                        "headers": headers,
                        "body": wanted[0].body,
                    }
                    text = sanitise(json.dumps(record, indent=1, ensure_ascii=False), root)
                    (args.out / f"{label}.json").write_text(text + "\n")
                    print(f"{label}: {len(sent)} requests, {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
