"""How often real Claude Code completes a file-writing task on agentkv: N tries, one table.

    python -m tests.claude.tool_task_rate --tries 10
    python -m tests.claude.tool_task_rate --tries 3 --server-args "--ctx-per-slot 32768"

It starts ``agentkv-server`` with its defaults (plus ``--server-args``) unless ``--url`` names one
that is already running, then runs ``claude -p "Create a file named hello.txt containing exactly the
text: hi" --permission-mode acceptEdits`` in a fresh git project per try, through a recording proxy.
Each try is one of: ``ok`` (Claude Code ended and the file holds exactly ``hi``), ``wrong-content``,
``no-file`` (Claude Code ended normally without the file), ``error`` (it ended with a non-zero
status), ``timeout`` (killed at ``--timeout``; ``file_ok`` says whether the file was right
anyway). The CLI comes from ``$AGENTKV_CLAUDE_BIN`` or ``claude`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agentkv_server.cli import claude_code_env
from tests.claude._cli import (
    AgentKVServer,
    RecordingProxy,
    find_claude,
    make_project,
    run_claude,
    temporary_root,
)

TASK = "Create a file named hello.txt containing exactly the text: hi"


def classify(returncode: int | None, timed_out: bool, hello: Path) -> str:
    if timed_out:
        return "timeout"
    if hello.is_file():
        return "ok" if hello.read_text().strip() == "hi" else "wrong-content"
    return "no-file" if returncode == 0 else "error"


def one_try(n: int, lines: list[str], url: str, root: Path, timeout: float) -> dict[str, Any]:
    project = make_project(root / f"try-{n:02d}" / "demo")
    with RecordingProxy(url) as proxy:
        run = run_claude(
            lines,
            TASK,
            project=project,
            home=root / "home",
            args=["--permission-mode", "acceptEdits"],
            timeout=timeout,
            base_url=proxy.url,
        )
    sent = proxy.messages()
    hello = project / "hello.txt"
    return {
        "try": n,
        "outcome": classify(run.returncode, run.timed_out, hello),
        "elapsed_s": round(run.elapsed, 1),
        "exit": run.returncode,
        "requests": len(sent),
        "distinct_requests": len({e.identity() for e in sent}),
        "retries": sum(1 for e in sent if e.retry_count > 0),
        "file": hello.read_text()[:200] if hello.is_file() else None,
        # The file can be right although the session did not end in time.
        "file_ok": hello.is_file() and hello.read_text().strip() == "hi",
        "last_output": (run.stdout.strip() or run.stderr.strip())[-300:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per try")
    parser.add_argument("--server-args", default="", help="extra agentkv-server flags")
    parser.add_argument("--url", help="use this running agentkv-server instead of starting one")
    parser.add_argument(
        "--ctx-per-slot", type=int, default=32768, help="its context per slot (with --url)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    print(f"claude: {find_claude()}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    with temporary_root("agentkv-tool-task-") as root:
        if args.url:
            lines = claude_code_env(args.url, None, ctx_per_slot=args.ctx_per_slot).splitlines()
            server = None
            url = args.url
        else:
            server = AgentKVServer(root / "server", extra_args=shlex.split(args.server_args))
            server.start()
            lines, url = server.env_lines, server.url
        try:
            started = time.monotonic()
            for n in range(1, args.tries + 1):
                result = one_try(n, lines, url, root, args.timeout)
                results.append(result)
                print(json.dumps(result), flush=True)
            wall = time.monotonic() - started
        finally:
            if server is not None:
                server.stop()
    counts = Counter(r["outcome"] for r in results)
    summary = {
        "tries": len(results),
        "outcomes": dict(counts),
        "success_rate": round(counts["ok"] / len(results), 3) if results else None,
        "file_ok": sum(1 for r in results if r["file_ok"]),
        "wall_s": round(wall, 1),
        "max_try_s": max((r["elapsed_s"] for r in results), default=None),
        "lines": lines,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "tries": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
