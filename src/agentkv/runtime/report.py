"""One finished request in one log line: what a person reads, and the same facts as fields.

The runtime logs it at INFO when a request ends (``agentkv.runtime``); the line carries the fields
as ``record.agentkv_request`` too, so a JSON log formatter writes them as data rather than text.

::

    request agent=coder priority=1 slot=0 source=slot cached=11830/12004 computed=174
        ttft=0.61s total=4.20s output=96 status=ok
        diverged="token 11830 in message 7 block 1: reused 11830, computed 174, ~0.4 s"

(one line; wrapped here). ``diverged`` appears only when the record says where the prompt left
the best cached candidate; ``parent`` and ``description`` only for a sub-agent (where known);
``retried``, ``suspended=N``, ``stopped=…``, ``joined=N`` only when
they happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv.runtime.lifecycle import RequestRecord

__all__ = ["divergence_text", "request_fields", "request_line"]


def request_fields(record: RequestRecord) -> dict[str, Any]:
    """The facts of the request line, as data."""
    fields: dict[str, Any] = {
        "agent": record.agent,
        "parent": getattr(record, "parent", None),
        "description": getattr(record, "description", None),
        "waited_on": getattr(record, "waited_on", None),
        "priority": record.priority,
        "slot": record.slot,
        "source": record.source,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "computed_tokens": record.computed_tokens,
        "output_tokens": record.output_tokens,
        "queued_s": record.queued_s,
        "ttft_s": record.ttft_s,
        "total_s": record.total_s,
        "status": record.status,
        "retried": record.retried,
        "suspended": record.suspended,
        "stopped": record.stopped,
        "attached": record.attached,
    }
    divergence = _divergence(record)
    if divergence is not None:
        fields["divergence"] = dict(divergence)
    return fields


def request_line(record: RequestRecord) -> str:
    """The request as one ``key=value`` line (values with spaces are quoted)."""
    parts = [
        "request",
        f"agent={_quoted(record.agent)}",
        *_tree_parts(record),
        f"priority={record.priority}",
        f"slot={_or_dash(record.slot)}",
        f"source={_or_dash(record.source)}",
        f"cached={record.cached_tokens}/{record.prompt_tokens}",
        f"computed={record.computed_tokens}",
        f"ttft={_seconds(record.ttft_s)}",
        f"total={_seconds(record.total_s)}",
        f"output={record.output_tokens}",
        f"status={_quoted(record.status)}",
    ]
    if record.retried:
        parts.append("retried")
    if record.suspended:
        parts.append(f"suspended={record.suspended}")
    if record.stopped:
        parts.append(f"stopped={record.stopped}")
    if record.attached > 1:
        parts.append(f"joined={record.attached - 1}")
    divergence = _divergence(record)
    if divergence is not None:
        parts.append(f"diverged={_quoted(divergence_text(divergence))}")
    return " ".join(parts)


def _tree_parts(record: RequestRecord) -> list[str]:
    """``parent=…``, ``description=…`` and ``waited_on`` or ``background`` for a sub-agent's
    request (read by name: older records have no such fields)."""
    parts = []
    parent = getattr(record, "parent", None)
    if parent:
        parts.append(f"parent={_quoted(parent)}")
    description = getattr(record, "description", None)
    if description:
        parts.append(f"description={_quoted(description)}")
    waited = getattr(record, "waited_on", None)
    if parent and waited is not None:
        parts.append("waited_on" if waited else "background")
    return parts


def divergence_text(divergence: Mapping[str, Any]) -> str:
    """Where a prompt left the best cached candidate, in words.

    Reads ``position`` (token), ``section`` ("system", "tool 3 (Bash)", "message 2 block 1"),
    ``reused`` and ``computed`` (tokens) and ``seconds`` (the estimated cost of the computed
    part); any other keys are shown as ``key=value``.
    """
    known = {"position", "section", "reused", "computed", "seconds"}
    words = []
    position, section = divergence.get("position"), divergence.get("section")
    if position is not None or section:
        where = f"token {position}" if position is not None else ""
        if section:
            where = f"{where} in {section}" if where else f"in {section}"
        words.append(where)
    costs = []
    if divergence.get("reused") is not None:
        costs.append(f"reused {divergence['reused']}")
    if divergence.get("computed") is not None:
        costs.append(f"computed {divergence['computed']}")
    seconds = divergence.get("seconds")
    if isinstance(seconds, int | float):
        costs.append(f"~{seconds:.1f} s")
    if costs:
        words.append(", ".join(costs))
    extra = [f"{k}={v}" for k, v in divergence.items() if k not in known]
    if extra:
        words.append(" ".join(extra))
    return ": ".join(words)


def _divergence(record: RequestRecord) -> Mapping[str, Any] | None:
    # Read by name: older records (and runtimes) have no such field.
    value = getattr(record, "divergence", None)
    return value if isinstance(value, Mapping) and value else None


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _quoted(text: str) -> str:
    if not text or any(c in text for c in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text
