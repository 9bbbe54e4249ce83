"""What the server writes to its log, and how.

At ``info`` the log is one line per finished request, warnings, errors and the startup block;
httpx's line per engine call and uvicorn's chatter and access lines only come with ``debug``.
``--log-format json`` writes one JSON object per line: ``time``, ``level``, ``logger``, ``message``,
plus ``request`` or ``startup`` when the record carries them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "JsonFormatter",
    "announce",
    "configure",
    "say",
    "startup_block",
    "startup_fields",
    "uvicorn_options",
]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("agentkv.server")

#: Set by :func:`configure`: how :func:`say` and the startup block are written.
_format = "text"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; structured facts the record carries become fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for attribute, key in (("agentkv_request", "request"), ("agentkv_startup", "startup")):
            value = getattr(record, attribute, None)
            if isinstance(value, Mapping):
                data[key] = dict(value)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send every logger to stderr at ``level``, as text or JSON lines, and keep the HTTP
    chatter (httpx, uvicorn) out of it unless ``level`` is ``debug``."""
    global _format
    _format = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):  # removed, not closed: an embedder may still use its own
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    debug = level == "debug"
    # One line per engine call: the request line already says what happened.
    logging.getLogger("httpx").setLevel(logging.DEBUG if debug else logging.WARNING)
    # httpcore's connection trace is too fine even for debugging agentkv.
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.WARNING)


def uvicorn_options(level: str) -> dict[str, Any]:
    """uvicorn's settings that go with :func:`configure`: its records go to the same handler
    (no logging config of its own), and the access line per HTTP request only when debugging
    (the page polls every second)."""
    debug = level == "debug"
    return {"log_config": None, "access_log": debug, "log_level": "debug" if debug else "warning"}


def say(message: str) -> None:
    """A line for the person who started the server (progress before the startup block)."""
    if _format == "json":
        log.info("%s", message)
    else:
        print(f"agentkv-server: {message}", file=sys.stderr, flush=True)


def startup_fields(
    *,
    engine: str,
    launched: bool,
    model: str | None,
    slots: int,
    ctx_per_slot: int | None,
    store: str | None,
    store_budget: int | None,
    url: str,
    api_key: bool,
    claude_code: str,
    device: str | None = None,
    warnings: Sequence[str] = (),
    codex: str | None = None,
    engine_name: str = "llama-server",
) -> dict[str, Any]:
    """What a user needs once the server is up, as data. ``engine_name``: another engine than
    llama-server places requests itself, and agentkv's slots are how many it sends at once."""
    return {
        "engine": engine,
        "engine_name": engine_name,
        "device": device,
        "warnings": list(warnings),
        "launched": launched,
        "model": model,
        "slots": slots,
        "ctx_per_slot": ctx_per_slot,
        "store": store,
        "store_budget": store_budget,
        "api": url,
        "api_key_required": api_key,
        "page": f"{url}/agentkv/",
        "metrics": f"{url}/metrics",
        "slot_table": f"{url}/agentkv/slots",
        "claude_code": claude_code,
        "codex": codex,
    }


def startup_block(fields: Mapping[str, Any]) -> str:
    """The startup block as text: where things are, then the lines for Claude Code."""
    engine = fields["engine"] + (" (launched by agentkv)" if fields["launched"] else "")
    ctx = fields["ctx_per_slot"]
    store = fields["store"]
    if store and fields.get("store_budget"):
        store = f"{store} (up to {fields['store_budget'] / 2**30:.1f} GiB)"
    name = fields.get("engine_name") or "llama-server"
    slots = f"{fields['slots']} × {ctx if ctx is not None else '?'} tokens"
    if name != "llama-server":
        slots = f"{fields['slots']} requests at once, placed by {name} ({ctx or '?'} tokens each)"
    rows = [
        ("engine", f"{name} at {engine}"),
        ("model", fields["model"] or f"the one {name} loaded"),
        *([("device", fields["device"])] if fields.get("device") else []),
        ("slots", slots),
        ("store", store or "off"),
        ("API", fields["api"] + (" (x-api-key required)" if fields["api_key_required"] else "")),
        ("page", fields["page"]),
        ("metrics", fields["metrics"]),
        ("status", f"agentkv-server status --url {fields['api']} --watch"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["agentkv-server is ready", ""]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    lines += [f"\n  warning: {text}" for text in fields.get("warnings") or ()]
    lines += ["", "Point Claude Code at it:", "", fields["claude_code"], ""]
    if fields.get("codex"):
        lines += [
            "Point Codex at it ($CODEX_HOME/config.toml, by default ~/.codex/config.toml):",
            "",
            fields["codex"],
            "",
        ]
    return "\n".join(lines)


def announce(fields: Mapping[str, Any]) -> None:
    """Write the startup block: as text, or as one JSON record with the same facts."""
    if _format == "json":
        log.info("ready", extra={"agentkv_startup": dict(fields)})
    else:
        print(startup_block(fields), file=sys.stderr, flush=True)
