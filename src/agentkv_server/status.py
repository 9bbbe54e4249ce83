"""``agentkv-server status``: the slot, queue and store table of a running server, as plain text.

For a person on SSH: the live page's facts without a browser. It reads ``GET /agentkv/slots``
(with ``--api-key`` or ``$AGENTKV_API_KEY`` when the server needs one); ``--watch`` redraws it
every ``--interval`` seconds until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import attrs
import httpx

from agentkv.agents import AgentView
from agentkv.runtime.record import divergence_text
from agentkv.snapshot import (
    QueueRow,
    RequestView,
    RuntimeSnapshot,
    SlotRow,
    SnapshotShapeError,
    structure_snapshot,
)

__all__ = ["add_server_options", "build_parser", "fetch", "main", "render"]

DEFAULT_URL = "http://127.0.0.1:8788"
_CLEAR = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """The table could not be read; the message says why, in words."""


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--api-key`` of a running agentkv-server (from the environment by default)."""
    parser.add_argument(
        "--url",
        default=os.environ.get("AGENTKV_URL", DEFAULT_URL),
        help=f"the server (default: $AGENTKV_URL, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AGENTKV_API_KEY"),
        help="the server's API key, if it has one (default: $AGENTKV_API_KEY)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-server status",
        description="Show the slots, queue, prefix store and recent requests of a running "
        "agentkv-server.",
    )
    add_server_options(parser)
    parser.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between redraws (default 1)"
    )
    return parser


def fetch(
    url: str, api_key: str | None = None, *, transport: httpx.BaseTransport | None = None
) -> RuntimeSnapshot:
    """The server's snapshot (``GET /agentkv/slots``); :class:`StatusError` when unreadable,
    or when its shape is not this version's."""
    headers = {"x-api-key": api_key} if api_key else {}
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            response = client.get(f"{url.rstrip('/')}/agentkv/slots", headers=headers)
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach agentkv at {url}: {exc}") from exc
    if response.status_code == 401:
        raise StatusError(
            f"{url} needs its API key: pass --api-key or set AGENTKV_API_KEY"
            if not api_key
            else f"{url} refused that API key"
        )
    if response.status_code != 200:
        raise StatusError(f"{url}/agentkv/slots answered HTTP {response.status_code}")
    try:
        data = response.json()
    except ValueError as exc:
        raise StatusError(f"{url}/agentkv/slots did not answer JSON; is it agentkv?") from exc
    try:
        return structure_snapshot(data)
    except SnapshotShapeError as exc:
        raise StatusError(
            f"{url}/agentkv/slots answered a snapshot of another shape ({exc}); "
            "is the server another version of agentkv?"
        ) from exc


# -- rendering ------------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}s" if value < 10 else f"{value:.0f}s"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole)}%" if whole else "-"


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _table(
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: set[int],
    empty: str = "",
) -> list[str]:
    """A blank line, ``title``, then ``rows`` in columns under ``header`` (columns ``right``
    aligned right), or ``empty`` in their place when there are none."""
    if not rows and empty:
        return ["", title, f"  {empty}"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            str(cell).rjust(widths[i]) if i in right else str(cell).ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  " + "  ".join(cells).rstrip()

    return ["", title, line(header), *(line(row) for row in rows)]


def _slot_progress(row: SlotRow, snapshot: RuntimeSnapshot) -> str:
    running = next(
        (r for r in snapshot.running if r.slot == row.slot and r.status == "running"), None
    )
    if row.state == "prefilling":
        for checkpoint in snapshot.checkpoints:
            if checkpoint.slot == row.slot:
                done, total = checkpoint.progress, checkpoint.tokens
                return f"shared head {_num(done)}/{_num(total)} ({_pct(done, total)})"
        if running is not None and running.prefilled is not None:
            done, total = running.prefilled, running.prompt_tokens
            return f"{_num(done)}/{_num(total)} prompt tokens ({_pct(done, total)})"
        if running is not None:
            return f"{_num(running.prompt_tokens)} prompt tokens, starting"
        return "starting"
    if row.state == "decoding" and running is not None:
        seconds = running.generating_s or 0.0
        generated = running.generated
        rate = f"{generated / seconds:.1f} tokens/s" if seconds >= 0.5 else "- tokens/s"
        return f"{rate}, {_num(generated)} generated"
    if row.idle_s is not None:
        return f"idle {_secs(row.idle_s)}" + (", saved" if row.stored else "")
    return ""


def _labelled(row: SlotRow | QueueRow | RequestView) -> str:
    """An agent's name, with the description of the call that started it where known."""
    agent = row.agent or "-"
    return f"{agent} ({row.description})" if row.description else agent


def _tree(tree: Sequence[AgentView]) -> list[str]:
    """The agent tree: each coordinator, then its sub-agents indented under it."""
    rows = []
    for row in tree:
        name = row.agent
        if row.parent and name.startswith(row.root + "/"):
            name = name[len(row.root) + 1 :]
        if row.depth:
            name = "  " * (row.depth - 1) + "└ " + name
        if row.waiting_for:
            state = f"waits for {_count(row.waiting_for, 'sub-agent', 'sub-agents')}"
        elif row.parent:
            state = "waited on" if row.waited_on else "background"
        else:
            state = ""
        what = row.description or ""
        if row.subagent_type:
            kind = row.subagent_type
            what = f"{what} [{kind}]" if what else f"[{kind}]"
        rows.append([name, str(row.priority), str(row.requests), state, what])
    header = ["agent", "prio", "requests", "state", "started for"]
    return _table(f"agents ({len(tree)})", header, rows, {2}, "none yet")


def render(snapshot: RuntimeSnapshot, *, url: str = "", now: float | None = None) -> str:
    """The snapshot as plain text: slots, queue, the agent tree, store and placements, recent
    requests."""
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    out = [f"agentkv {url}  {stamp}" if url else f"agentkv  {stamp}"]
    slots = snapshot.slots
    rows = [
        [
            str(row.slot),
            _labelled(row),
            "-" if row.priority is None else str(row.priority),
            _num(row.tokens),
            row.state,
            _slot_progress(row, snapshot),
        ]
        for row in slots
    ]
    header = ["slot", "agent", "prio", "tokens", "state", "progress"]
    out += _table(f"slots ({len(slots)})", header, rows, {3})

    queue = snapshot.queue
    checkpoints = {c.id: c for c in snapshot.checkpoints}
    rows = []
    for ticket in queue:
        waits = "a slot"
        blocked = ticket.waiting_for_checkpoint
        if blocked is not None:
            c = checkpoints.get(blocked)
            waits = f"checkpoint #{blocked}" + (
                f" on slot {c.slot} ({_pct(c.progress, c.tokens)})" if c else ""
            )
        rows.append(
            [
                str(ticket.ticket),
                _labelled(ticket),
                str(ticket.priority),
                _num(ticket.tokens),
                _secs(ticket.waited_s),
                f"{ticket.score:.2f}",
                waits,
            ]
        )
    header = ["ticket", "agent", "prio", "tokens", "waited", "score", "waits for"]
    out += _table(f"queue ({len(queue)})", header, rows, {3, 4, 5}, "nobody is waiting")
    out += _tree(snapshot.tree)

    out.append("")
    placements = snapshot.placements
    warm = placements.from_slot + placements.from_store
    out.append(
        f"placements: {_pct(warm, placements.acquired)} warm ({placements.from_slot} from a "
        f"slot, {placements.from_store} from the store, {placements.cold} cold)"
    )
    store = snapshot.store
    if store is None:
        out.append("store: off")
    else:
        out.append(
            f"store: {_count(len(store.entries), 'entry', 'entries')}, "
            f"{_bytes(store.bytes)} of "
            f"{_bytes(store.budget)}, {store.saves} saves, {store.restores} restores, "
            f"{store.seconds_saved:.1f}s of prefill saved"
        )

    rows = [
        [
            _labelled(r),
            str(r.priority),
            "-" if r.slot is None else str(r.slot),
            r.source or "-",
            f"{_num(r.cached_tokens)}/{_num(r.prompt_tokens)}",
            _secs(r.ttft_s),
            _secs(r.total_s),
            r.status,
            divergence_text(attrs.asdict(r.divergence)) if r.divergence else "",
        ]
        for r in list(reversed(snapshot.recent))[:8]
    ]
    header = ["agent", "prio", "slot", "source", "cached/prompt", "ttft", "total", "status", "why"]
    out += _table("recent requests (newest first)", header, rows, {4, 5, 6}, "none yet")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clear = args.watch and sys.stdout.isatty()
    try:
        while True:
            try:
                text = render(fetch(args.url, args.api_key), url=args.url)
            except StatusError as exc:
                if not args.watch:
                    print(f"agentkv-server status: {exc}", file=sys.stderr)
                    return 1
                text = f"agentkv-server status: {exc}; retrying\n"
            sys.stdout.write((_CLEAR if clear else "") + text)
            sys.stdout.flush()
            if not args.watch:
                return 0
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0
