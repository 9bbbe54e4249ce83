"""Capture what the real Claude Code CLI sends around its own auto-compaction, without a model.

``CompactionStub`` is a small Messages API on a free loopback port. It records every request (path,
query, headers, JSON body) and what it answered, and answers:

- a compaction request (its last user message holds :data:`COMPACTION_MARK`) with
  ``<analysis>…</analysis>`` and ``<summary>…</summary>`` (or, while ``no_summary`` is above
  zero, with an ``<analysis>`` alone, to see the retry; or with the next of ``odd_replies``
  while there is one, to see what Claude Code makes of replies of other shapes);
- any other ``/v1/messages`` request with the next scripted reply of :attr:`CompactionStub.script`
  (text, ``thinking`` with a signature, ``tool_use``), or a short text when the script is empty,
  reporting :attr:`CompactionStub.input_tokens` (or the reply's own) as ``usage.input_tokens``;
- ``count_tokens`` with ``{"input_tokens": 1}``.

Claude Code compacts when the last ``usage`` plus its estimate of what was added since reaches
``window − min(max output, 20000) − 13000``: 15,672 with the lines below (docs/claude-code.md,
"Window and compaction"). Reporting :data:`HIGH` (15,667 input + 3 output) makes the next turn
begin with a compaction request; :data:`LOW` never does.

``python -m tests.claude.capture_compaction OUT`` runs the scenarios of :data:`SCENARIOS`, each in
a fresh git project with its own HOME, and writes ``OUT/<scenario>.json``: every request in
arrival order with the stub's reply, the project directory written as ``<project>``, HOME as
``<home>`` (:func:`scrub`), and ``OUT/tools.json``: the ``tools`` list, which every body that
carried the same list names instead (:func:`share_tools`). The CLI is ``$AGENTKV_CLAUDE_BIN`` or
``claude`` on PATH. Not run by pytest; ``tests/test_claude_code_compaction.py`` checks the files
it wrote.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

from tests._cli_run import run_bounded
from tests.claude._cli import CLAUDE_CODE_VERSION, find_claude, make_project
from tests.claude.capture import CLIENT_ENV, client_env

#: The first words of the user message Claude Code appends to ask for a summary.
COMPACTION_MARK = "CRITICAL: Respond with TEXT ONLY."
#: ``usage.input_tokens`` that makes the next request a compaction (with 3 output tokens).
HIGH = 15_667
#: ``usage.input_tokens`` far below the compaction point.
LOW = 1_000

#: The compaction reply the stub gives (a summary Claude Code accepts).
SUMMARY_REPLY = (
    "<analysis>\nThe user asked for single words; each was given.\n</analysis>\n\n"
    "<summary>\n1. Primary Request and Intent:\n   The user asked for single words.\n"
    "2. Pending Tasks:\n   None.\n</summary>"
)
#: The reply that lacks a ``<summary>``.
NO_SUMMARY_REPLY = "<analysis>\nThe user asked for single words.\n</analysis>"

#: Request headers not recorded (they say nothing about the client).
_UNRECORDED = {"host", "content-length", "connection"}


def _frame(event: Mapping[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def thinking(value: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": value, "signature": "sig-" + secrets.token_hex(16)}


def tool_use(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + secrets.token_hex(12),
        "name": name,
        "input": dict(arguments),
    }


@attrs.frozen
class Reply:
    """One scripted reply: its content blocks, as the client should assemble them."""

    content: Sequence[Mapping[str, Any]]
    input_tokens: int | None = None
    output_tokens: int = 3
    #: How it ended (None: ``tool_use`` when it calls a tool, else ``end_turn``).
    stop_reason: str | None = None


def stream(model: str, reply: Reply, input_tokens: int) -> tuple[bytes, dict[str, Any]]:
    """The SSE stream for ``reply`` and the message it assembles to."""
    stop = "tool_use" if any(b["type"] == "tool_use" for b in reply.content) else "end_turn"
    stop = reply.stop_reason or stop
    message: dict[str, Any] = {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
    }
    frames = [_frame({"type": "message_start", "message": message})]
    for index, block in enumerate(reply.content):
        kind = block["type"]
        if kind == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        frames.append(
            _frame({"type": "content_block_start", "index": index, "content_block": start})
        )
        frames += [
            _frame({"type": "content_block_delta", "index": index, "delta": d}) for d in deltas
        ]
        frames.append(_frame({"type": "content_block_stop", "index": index}))
    usage = {"input_tokens": input_tokens, "output_tokens": reply.output_tokens}
    frames.append(
        _frame(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": usage,
            }
        )
    )
    frames.append(_frame({"type": "message_stop"}))
    assembled = {**message, "content": [dict(b) for b in reply.content], "stop_reason": stop}
    assembled["usage"] = usage
    return b"".join(frames), assembled


def last_user_text(body: Any) -> str:
    """The text of the last message when it is the user's (all its text blocks joined)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not messages or messages[-1].get("role") != "user":
        return ""
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


def is_compaction(body: Any) -> bool:
    return COMPACTION_MARK in last_user_text(body)


@attrs.define
class CompactionStub:
    """The Messages API described in the module docstring."""

    input_tokens: int = LOW
    no_summary: int = 0
    #: Compaction replies to give first: a text, or the texts of several text blocks.
    odd_replies: list[str | Sequence[str] | Reply] = attrs.field(factory=list)
    script: list[Reply] = attrs.field(factory=list)
    exchanges: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _server: ThreadingHTTPServer | None = attrs.field(default=None, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _answer(self, path: str, body: Any) -> tuple[int, str, bytes, dict[str, Any]]:
        if path == "/v1/messages/count_tokens":
            return 200, "application/json", b'{"input_tokens":1}', {"input_tokens": 1}
        if path != "/v1/messages" or not isinstance(body, dict):
            payload = b'{"type":"error","error":{"type":"not_found_error","message":"stub"}}'
            return 404, "application/json", payload, {"status": 404}
        model = str(body.get("model", "agentkv-local"))
        if is_compaction(body):
            summary = self.no_summary <= 0
            self.no_summary -= 1
            said: str | Sequence[str] | Reply = SUMMARY_REPLY if summary else NO_SUMMARY_REPLY
            if self.odd_replies:
                said = self.odd_replies.pop(0)
            if isinstance(said, Reply):
                reply = said
            else:
                blocks = [said] if isinstance(said, str) else said
                reply = Reply([text(block) for block in blocks], LOW, 60)
            kind = "compaction"
        else:
            reply = self.script.pop(0) if self.script else Reply([text("ok")])
            kind = "turn"
        tokens = self.input_tokens if reply.input_tokens is None else reply.input_tokens
        payload, assembled = stream(model, reply, tokens)
        return 200, "text/event-stream", payload, {"kind": kind, "message": assembled}

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                path, _, query = self.path.partition("?")
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                headers = {
                    k.lower(): v for k, v in self.headers.items() if k.lower() not in _UNRECORDED
                }
                with owner._lock:
                    status, kind, payload, answer = owner._answer(path, body)
                    owner.exchanges.append(
                        {
                            "method": self.command,
                            "path": path,
                            "query": query,
                            "headers": headers,
                            "body": body,
                            "answer": answer,
                        }
                    )
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

    def __enter__(self) -> CompactionStub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@attrs.frozen
class Step:
    """One ``claude -p`` run of a scenario: its prompt, extra flags, and how the stub answers."""

    prompt: str
    cont: bool = True
    replies: Sequence[Reply] = ()
    input_tokens: int = HIGH
    no_summary: int = 0
    odd_replies: Sequence[str | Sequence[str] | Reply] = ()
    flags: Sequence[str] = ()


def words(*names: str, tokens: int = HIGH, fresh: bool = True) -> list[Step]:
    """Turns that each ask for one word and are answered with it: a ``-p`` turn (unless not
    ``fresh``), then ``--continue`` turns."""
    return [
        Step(
            f"Reply with the single word: {w}",
            cont=i > 0 or not fresh,
            replies=[Reply([text(w)])],
            input_tokens=tokens,
        )
        for i, w in enumerate(names)
    ]


def _read(path: str) -> Reply:
    return Reply([tool_use("Read", {"file_path": path})])


#: name -> the runs, in one fresh project and HOME.
SCENARIOS: dict[str, Callable[[], list[Step]]] = {
    # four turns, every reply above the point: turns 3 and 4 each start with a compaction (the
    # first reply of a session never leads to one)
    "turns": lambda: words("alpha", "beta", "gamma", "delta"),
    # the same in another project and session: is the instruction the same?
    "turns_again": lambda: words("alpha", "beta", "gamma"),
    # the same turns far below the point: what a normal --continue request looks like
    "baseline": lambda: words("alpha", "beta", "gamma", tokens=LOW),
    # the replies carry a thinking block with a signature before their text
    "thinking": lambda: [
        Step(
            f"Reply with the single word: {w}",
            cont=i > 0,
            replies=[Reply([thinking(f"The user wants {w}."), text(w)])],
        )
        for i, w in enumerate(("alpha", "beta", "gamma"))
    ],
    # the first compaction reply has no <summary>
    "retry": lambda: [
        *words("alpha", "beta"),
        Step("Reply with the single word: gamma", no_summary=1, replies=[Reply([text("gamma")])]),
    ],
    # neither compaction reply has a <summary>: what Claude Code does after its retry
    "retry_twice": lambda: [
        *words("alpha", "beta"),
        Step("Reply with the single word: gamma", no_summary=2, replies=[Reply([text("gamma")])]),
    ],
    # neither compaction reply has a <summary>, and they differ: which one the summary is
    "retry_twice_differs": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=[
                "The user asked for single words.\n\n\nNothing is pending.",
                "<analysis>\nThe second attempt.\n</analysis>",
            ],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # a <summary> opened at a line's start and never closed, the <analysis> unclosed too: is it
    # asked for again?
    "open_summary": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=["<analysis>\nUnclosed.\n\n<summary>\n1. Single words.\n"],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # a compaction reply of two text blocks (agentkv releases text it held back as a possible
    # tool call as a block of its own): how Claude Code reads them
    "two_blocks": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=[
                [
                    "<analysis>\nTwo blocks.\n</analysis>\n\n<summary>\n1. Single words, then",
                    '```json\n{"word": "beta"}\n```\n</summary>',
                ]
            ],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # two replies of two text blocks, none with a <summary>: which block the summary is
    "two_blocks_no_summary": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=[
                ["The first reply, its first block.", "The first reply, its second block."],
                ["The retry, its first block.", "The retry, its second block."],
            ],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # the retry's reply has its summary but was cut at the token limit: which reply is the summary
    "retry_cut": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=[
                "Beta",
                Reply([text(SUMMARY_REPLY + "\n\nMore")], LOW, 60, stop_reason="max_tokens"),
            ],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # the first reply has its summary but was cut at the token limit: is it asked for again?
    "cut": lambda: [
        *words("alpha", "beta"),
        Step(
            "Reply with the single word: gamma",
            odd_replies=[
                Reply([text(SUMMARY_REPLY + "\n\nMore")], LOW, 60, stop_reason="max_tokens")
            ],
            replies=[Reply([text("gamma")])],
        ),
    ],
    # a turn whose tool calls are answered above the point: compaction between tool calls
    "tool_call": lambda: [
        Step(
            "Reply with the single word: alpha",
            cont=False,
            input_tokens=LOW,
            replies=[Reply([text("alpha")])],
        ),
        Step(
            "Read README.md and reply with its first line.",
            replies=[_read("README.md"), _read("README.md"), Reply([text("# demo")])],
        ),
    ],
    # a longer conversation below the point, with tool calls, then one reply above it: which
    # messages the request after the compaction keeps
    "long": lambda: [
        *words("alpha", "beta", tokens=LOW),
        Step(
            "Read README.md and reply with its first line.",
            input_tokens=LOW,
            replies=[_read("README.md"), Reply([text("# demo")])],
        ),
        *words("gamma", tokens=LOW, fresh=False),
        Step(
            "Read README.md again, then reply with the single word: epsilon",
            replies=[_read("README.md"), Reply([text("epsilon")])],
        ),
        Step("Reply with the single word: zeta", replies=[Reply([text("zeta")])]),
    ],
}


def dashed(path: str) -> str:
    """A path as Claude Code names its project directory: every ``/`` and ``.`` a ``-``."""
    return re.sub(r"[^A-Za-z0-9]", "-", path)


def scrub(value: str, project: Path, home: Path) -> str:
    """``value`` with the project written ``<project>``, HOME ``<home>``, the device id zeroed."""
    for path, name in ((project, "<project>"), (home, "<home>")):
        for form in (str(path), str(path.resolve())):
            value = value.replace(dashed(form), f"-{name[1:-1]}-")
            value = value.replace(form, name)
    return re.sub(r'(\\"device_id\\":\\")[0-9a-f]{64}', lambda m: m.group(1) + "0" * 64, value)


def run_scenario(
    name: str, steps: Sequence[Step], root: Path, claude: Path, timeout: float = 180.0
) -> dict[str, Any]:
    project = make_project(root / name)
    home = root / f"home-{name}"
    runs: list[dict[str, Any]] = []
    with CompactionStub() as stub:
        for step in steps:
            stub.input_tokens = step.input_tokens
            stub.no_summary = step.no_summary
            stub.odd_replies = list(step.odd_replies)
            stub.script = list(step.replies)
            before = len(stub.exchanges)
            command = [str(claude), "-p", *(["--continue"] if step.cont else []), *step.flags]
            result = run_bounded(
                [*command, step.prompt],
                cwd=project,
                env=client_env(stub.url, home),
                timeout=timeout,
            )
            runs.append(
                {
                    "command": ["claude", *command[1:], step.prompt],
                    "input_tokens": step.input_tokens,
                    "returncode": result["returncode"],
                    "stdout": result["stdout"],
                    "stderr": result["stderr"],
                    "requests": list(range(before, len(stub.exchanges))),
                }
            )
        exchanges = list(stub.exchanges)
    record = {
        "claude_code": CLAUDE_CODE_VERSION,
        "scenario": name,
        "env": {**CLIENT_ENV, "ANTHROPIC_BASE_URL": "http://127.0.0.1:<port>"},
        "runs": runs,
        "exchanges": exchanges,
    }
    return json.loads(scrub(json.dumps(record, ensure_ascii=False), project, home))


#: The file that holds the ``tools`` list every captured request carried (see :func:`share_tools`).
TOOLS_FILE = "tools.json"


def share_tools(records: Sequence[dict[str, Any]]) -> list[Any] | None:
    """Replace each body's ``tools`` by :data:`TOOLS_FILE` where it equals the first request's;
    that list (or None when there were no requests)."""
    bodies = [e["body"] for r in records for e in r["exchanges"] if isinstance(e["body"], dict)]
    tools = next((b["tools"] for b in bodies if "tools" in b), None)
    for body in bodies:
        if tools is not None and body.get("tools") == tools:
            body["tools"] = TOOLS_FILE
    return tools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for <scenario>.json and tools.json")
    parser.add_argument("scenarios", nargs="*", help="which to run (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    claude = find_claude()
    records = []
    with tempfile.TemporaryDirectory(prefix="agentkv-compaction-") as name:
        root = Path(name)
        for scenario in args.scenarios or SCENARIOS:
            start = time.monotonic()
            records.append(run_scenario(scenario, SCENARIOS[scenario](), root, claude))
            kinds = [e["answer"].get("kind", e["path"]) for e in records[-1]["exchanges"]]
            print(f"{scenario}: {kinds}, {time.monotonic() - start:.1f} s", file=sys.stderr)
    tools = share_tools(records)
    if tools is not None:
        (args.out / TOOLS_FILE).write_text(json.dumps(tools, indent=1, ensure_ascii=False) + "\n")
    for record in records:
        text_ = json.dumps(record, indent=1, ensure_ascii=False)
        (args.out / f"{record['scenario']}.json").write_text(text_ + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
