"""What several benchmark scenarios share: Claude Code's headers, a ``claude -p`` run with a time
limit, the report of a run of configurations, and its check that no configuration saw an error."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

if TYPE_CHECKING:
    from agentkv_bench.scenarios import Bench

__all__ = ["by_name", "claude_code_headers", "errors_target", "run_claude", "scratch", "write_run"]


def claude_code_headers(session: str, priority: int, agent_id: str | None = None) -> dict[str, str]:
    """The headers of a Claude Code request in ``session`` (a sub-agent's with its ``agent_id``)."""
    headers = {
        "x-api-key": "bench",
        "anthropic-version": "2023-06-01",
        "x-claude-code-session-id": session,
        "x-agent-priority": str(priority),
    }
    if agent_id is not None:
        headers["x-claude-code-agent-id"] = agent_id
    return headers


@contextlib.contextmanager
def scratch(kind: str) -> Iterator[Path]:
    """A temporary directory for a run's projects, removed (whatever is left) once it ends."""
    with tempfile.TemporaryDirectory(
        prefix=f"agentkv-bench-{kind}-", ignore_cleanup_errors=True
    ) as root:
        yield Path(root)


async def run_claude(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], limit_s: float
) -> tuple[int | None, str, str]:
    """Run a ``claude`` command: its exit status (None: it ran past ``limit_s``), stdout, stderr."""
    try:
        with anyio.fail_after(limit_s):
            done = await anyio.run_process(list(command), cwd=cwd, env=env, check=False)
    except TimeoutError:
        return None, "", "timed out"
    return (
        done.returncode,
        done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )


async def write_run(
    bench: Bench,
    scenario: str,
    spec: Any,
    table: Callable[[dict[str, Any]], str],
    started: float,
    **fields: Any,
) -> dict[str, Any]:
    """The run's report (its spec, the engine setup, ``fields``, the time since ``started``),
    written as ``{scenario}.{json,txt}`` under ``bench.out``."""
    from agentkv_bench.report import write_report

    setup = bench.setup
    result = {
        "scenario": scenario,
        "spec": attrs.asdict(spec),
        "slots": setup.slots,
        "ctx_per_slot": setup.ctx,
        "model": setup.model.name,
        **fields,
        "total_s": round(time.monotonic() - started, 1),
    }
    await write_report(result, table(result), bench.out, stem=scenario)
    return result


def by_name(configs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A run's configurations by name."""
    return {c["name"]: c for c in configs}


def errors_target(configs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The target that no configuration saw an error."""
    return {
        "value": sum(c["errors"] for c in configs),
        "target": 0,
        "met": all(c["errors"] == 0 for c in configs),
    }
