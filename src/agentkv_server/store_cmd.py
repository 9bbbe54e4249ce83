"""``agentkv-server store clear``: delete saved KV states, all of them or one agent's.

A saved state is as sensitive as the transcript it encodes, so clearing it is one command. With a
server running it asks the server (``DELETE /agentkv/store``), which also forgets what it knew of
the deleted entries; with ``--offline`` it edits the store directory of a server that is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from agentkv.runtime.model import write_atomic
from agentkv.runtime.store import INDEX_FILE
from agentkv_server.status import add_server_options

__all__ = ["build_parser", "clear_offline", "clear_online", "main"]


class StoreCommandError(Exception):
    """The store could not be cleared; the message says why, in words."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-server store",
        description="Manage the prefix store (saved KV states) of agentkv-server.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    clear = commands.add_parser(
        "clear", help="delete saved KV states: every one, or those of one agent"
    )
    clear.add_argument("--agent", help="only this agent's entries (its X-Agent-Id)")
    add_server_options(clear)
    clear.add_argument(
        "--offline",
        metavar="DIR",
        type=Path,
        help="no server is running: clear the store directory DIR itself "
        "(the server's --store-dir, by default <cache dir>/store)",
    )
    return parser


def clear_online(
    url: str,
    api_key: str | None = None,
    *,
    agent: str | None = None,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Ask a running server to delete entries; returns how many it deleted."""
    headers = {"x-api-key": api_key} if api_key else {}
    params = {"agent": agent} if agent else {}
    try:
        with httpx.Client(transport=transport, timeout=60.0) as client:
            response = client.delete(
                f"{url.rstrip('/')}/agentkv/store", headers=headers, params=params
            )
    except httpx.HTTPError as exc:
        raise StoreCommandError(
            f"cannot reach agentkv at {url}: {exc} (is it stopped? then use --offline DIR)"
        ) from exc
    if response.status_code == 401:
        raise StoreCommandError(f"{url} needs its API key: pass --api-key or set AGENTKV_API_KEY")
    if response.status_code != 200:
        raise StoreCommandError(f"{url}/agentkv/store answered HTTP {response.status_code}")
    body: dict[str, Any] = response.json()
    return int(body.get("deleted", 0))


def clear_offline(directory: Path, *, agent: str | None = None) -> int:
    """Delete entries from the store directory of a stopped server; returns how many."""
    index_path = directory / INDEX_FILE
    if not directory.is_dir():
        raise StoreCommandError(f"{directory} is not a directory")
    try:
        index: dict[str, Any] = json.loads(index_path.read_text())
    except FileNotFoundError:
        index = {"entries": []}
    except (OSError, ValueError) as exc:
        raise StoreCommandError(f"cannot read {index_path}: {exc}") from exc
    entries: list[dict[str, Any]] = list(index.get("entries") or [])
    doomed = [e for e in entries if agent is None or e.get("agent") == agent]
    kept = [e for e in entries if e not in doomed]
    names = {f"{e['id']}.bin" for e in doomed if "id" in e}
    if agent is None:
        # Files no index knows are deleted by the server at startup anyway: take them too.
        names |= {p.name for p in directory.glob("akv-*.bin")}
    for name in names:
        (directory / name).unlink(missing_ok=True)
    if index_path.exists():
        index["entries"] = kept
        write_atomic(index_path, json.dumps(index).encode())
    return len(doomed)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.offline is not None:
            deleted = clear_offline(args.offline, agent=args.agent)
        else:
            deleted = clear_online(args.url, args.api_key, agent=args.agent)
    except StoreCommandError as exc:
        print(f"agentkv-server store: {exc}", file=sys.stderr)
        return 1
    whose = f" of agent {args.agent}" if args.agent else ""
    print(f"deleted {deleted} saved KV state{'s' if deleted != 1 else ''}{whose}")
    return 0
