"""The first agents of three projects, with a restart between the second and the third.

``python -m tests.claude.cross_project`` starts ``agentkv-server`` as a user would (its defaults,
a free port, a temporary store directory), runs the first ``claude -p`` agent in project A
(cold engine), then the first agent in project B, stops the server (Ctrl-C), starts it again on
the same store, and runs the first agent in project C, which it has never seen. For each it
prints the CLI's wall time and what the slot table says about the request: where the cached
part came from, cached and prompt tokens (llama-server's ``cache_n``), and the time to the first
token as agentkv measured it. ``--json FILE`` writes the same figures as JSON. ``--warm-store
DIR`` skips A and B and starts on a copy of a store another run left behind; ``--keep-store DIR``
leaves one (copied after A and B, with the server stopped).

The figures in docs/claude-code.md ("Fresh agents in other projects") come from this script.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from tests.claude._cli import (
    AgentKVServer,
    find_claude,
    make_project,
    run_claude,
    server_args_from_env,
    temporary_root,
)


def _agent(server: AgentKVServer, name: str, word: str, root: Path, claude: Path) -> dict[str, Any]:
    run = run_claude(
        server.env_lines,
        f"Reply with the single word: {word}",
        project=make_project(root / "projects" / name),
        home=root / "home",
        timeout=3600,
        claude=claude,
    )
    recent = [r for r in server.table().get("recent", []) if r.get("slot") is not None]
    record = recent[-1] if recent else {}
    row = {
        "project": name,
        "answer": run.stdout.strip(),
        "exit": run.returncode,
        "wall_s": round(run.elapsed, 2),
        "source": record.get("source"),
        "prompt_tokens": record.get("prompt_tokens"),
        "cached_tokens": record.get("cached_tokens"),
        "computed_tokens": record.get("computed_tokens"),
        "checkpoint_tokens": record.get("checkpoint_tokens"),
        "ttft_s": record.get("ttft_s"),
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument(
        "--warm-store",
        type=Path,
        help="skip A and B: start on a copy of this store directory (one an agentkv-server "
        "kept after a first agent in another project) and run only C",
    )
    parser.add_argument(
        "--keep-store",
        type=Path,
        help="copy the store to this directory after A and B (for later --warm-store runs)",
    )
    args = parser.parse_args(argv)
    claude = find_claude()
    rows = []
    with temporary_root("agentkv-xproj-") as root:
        extra = server_args_from_env()
        if args.warm_store is None:
            with AgentKVServer(root / "server", extra_args=extra) as server:
                rows.append(_agent(server, "a", "alpha", root, claude))
                rows.append(_agent(server, "b", "beta", root, claude))
            if args.keep_store is not None:
                shutil.copytree(root / "server" / "store", args.keep_store, dirs_exist_ok=True)
        else:
            shutil.copytree(args.warm_store, root / "server" / "store")
        with AgentKVServer(root / "server", extra_args=extra) as server:
            row = _agent(server, "c", "gamma", root, claude)
            row["after_restart"] = True
            rows.append(row)
        if args.json:  # the second server's log (C's request), beside the figures
            args.json.with_name(args.json.stem + "-server.log").write_text(server.log())
    if len(rows) == 3:
        print(f"B/A wall time: {rows[1]['wall_s'] / rows[0]['wall_s']:.3f}x")
    print(f"C first token after the restart: {rows[-1]['ttft_s']} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
