"""Three agents share one llama-server through agentkv's runtime, inside your own program.

A coordinator (priority 0), a frontend agent (1) and a test agent (2) each take two turns on a
shared system prompt; two slots serve them. ``Runtime`` does the rest: queue, slot choice by
cost, restore, stream, release. Run ``python examples/three_agents.py [--upstream URL]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import anyio

from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.record import RequestRecord, request_line

SYSTEM = (
    "You are one agent in a team of coding agents working on a web shop (Python back end, React "
    "front end). Read code before changing it, keep changes small, and answer in one short line."
)
AGENTS = {  # name: (priority, the two questions it asks)
    "coordinator": (0, ["Split 'add a discount code field' into steps.", "Who goes first?"]),
    "frontend": (1, ["Which component holds the discount input?", "Which hook stores it?"]),
    "tests": (2, ["Name one test for the discount endpoint.", "What status for a bad code?"]),
}


async def agent(runtime: Runtime, name: str, echo: Callable[[str], None]) -> None:
    """One agent's conversation: each turn goes through the runtime and extends the history."""
    priority, questions = AGENTS[name]
    history: list[dict[str, Any]] = []
    for question in questions:
        history.append({"role": "user", "content": question})
        body = {"model": "local", "system": SYSTEM, "messages": history, "max_tokens": 24}
        prepared = await runtime.prepare(body, agent=name, priority=priority)
        message = await runtime.submit(prepared).message()
        text = "".join(b.get("text", "") for b in message["content"])
        history.append({"role": "assistant", "content": text})
        echo(f"{name:<11} P{priority}: {text.strip()[:60]!r}")


async def main(
    upstream: str | None = None,
    *,
    echo: Callable[[str], None] = print,
    progress: Callable[[str], None] = print,
) -> list[RequestRecord]:
    """Run the three agents at once; return the runtime's record of every request.

    Without ``upstream``, llama-server is launched with the default model, two slots of 4096
    tokens and no prefix store; ``assemble`` reads the engine's real slots either way.
    """
    settings = EngineSettings(upstream=upstream, slots=2, ctx_per_slot=4096, store=False)
    async with assemble(settings, on_progress=progress) as built:
        async with built.runtime as runtime, anyio.create_task_group() as tg:
            for name in AGENTS:
                tg.start_soon(agent, runtime, name, echo)
        snapshot = runtime.snapshot()
    for record in runtime.records():  # the line the runtime logs as each request ends
        echo(request_line(record))
    echo(f"slots: {[(s.slot, s.agent, s.tokens) for s in snapshot.slots]}")
    return runtime.records()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream", metavar="URL", help="a running llama-server")
    args = parser.parse_args()
    records = anyio.run(main, args.upstream)
    sys.exit(0 if all(r.status == "ok" for r in records) else 1)
