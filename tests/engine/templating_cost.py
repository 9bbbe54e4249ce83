"""What the two engine calls before every reply cost on a real llama-server.

    python -m tests.engine.templating_cost [ROUNDS]

Starts llama-server with the default model (2 slots, a free port) and times, median of 15 each,
``/apply-template`` and ``/tokenize`` for a one-word request and for Claude Code's own first
request (``tests/fixtures/claude_code/b_file_task_3.json``, about 12,000 tokens), and
``LlamaSlotClient.prompt_tokens`` (both calls) on a kept-alive connection and on a new
connection per call, alternated ``ROUNDS`` times (default 3). Then what ``prompt_tokens`` costs
for a body asked about before (its memo), and for the session's next turn after the turn before
(``b_file_task_2`` then ``b_file_task_3``: tokenized from the kept turn's tokens and the rest),
against tokenizing it whole.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
from agentkv.runtime.model import default_model_path
from agentkv.translate import MessagesTranslator

FIXTURES = Path(__file__).parent.parent / "fixtures" / "claude_code"
FIXTURE = FIXTURES / "b_file_task_3.json"


def engine_body(path: Path) -> dict[str, Any]:
    request = json.loads(path.read_text())
    return MessagesTranslator().translate(request.get("body", request)).body


def bodies() -> dict[str, dict[str, Any]]:
    return {
        "one word": {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 16},
        "Claude Code's first request": engine_body(FIXTURE),
    }


async def next_turn(client: LlamaSlotClient, rounds: int) -> None:
    """The next turn's tokens: from the turn before's, against whole; and a body asked again."""
    previous, body = engine_body(FIXTURES / "b_file_task_2.json"), engine_body(FIXTURE)
    await client.prompt_tokens(previous)
    await client.prompt_tokens(body)  # the client's own check of its first pieces passes
    for r in range(rounds):
        took: dict[str, list[float]] = {"pieces": [], "whole": [], "again": []}
        for _ in range(15):
            for way in ("pieces", "whole"):
                client.memo.clear()
                await client.prompt_tokens(previous)
                checks, client._split_checks = (
                    client._split_checks,
                    (None if way == "whole" else 10**9),
                )
                started = time.perf_counter()
                await client.prompt_tokens(body)
                took[way].append(time.perf_counter() - started)
                client._split_checks = checks
            started = time.perf_counter()
            await client.prompt_tokens(body)
            took["again"].append(time.perf_counter() - started)
        ms = {way: sorted(t)[7] * 1000 for way, t in took.items()}
        print(
            f"  round {r + 1}: the next turn's prompt_tokens, from the turn before "
            f"{ms['pieces']:.1f} ms, whole {ms['whole']:.1f} ms; the same body again "
            f"{ms['again']:.2f} ms"
        )


async def median_ms(call: Callable[[], Awaitable[Any]], n: int = 15) -> float:
    took = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        took.append(time.perf_counter() - started)
    return sorted(took)[n // 2] * 1000


async def unremembered(client: LlamaSlotClient, body: dict[str, Any]) -> list[int]:
    """``prompt_tokens`` asking the engine both questions (nothing kept from before)."""
    client.memo.clear()
    return await client.prompt_tokens(body)


async def measure(
    name: str, body: dict[str, Any], kept: LlamaSlotClient, fresh: LlamaSlotClient, rounds: int
) -> None:
    text = await kept.apply_template(body)
    tokens = await kept.tokenize(text, add_special=True)
    print(f"{name}: {len(text)} characters templated, {len(tokens)} tokens")
    for r in range(rounds):
        template = await median_ms(lambda: kept.apply_template(body))
        tokenize = await median_ms(lambda: kept.tokenize(text, add_special=True))
        new = await median_ms(lambda: unremembered(fresh, body))
        both = await median_ms(lambda: unremembered(kept, body))
        print(
            f"  round {r + 1}: apply-template {template:.1f} ms, tokenize {tokenize:.1f} ms; "
            f"both, a new connection each {new:.1f} ms, kept-alive {both:.1f} ms"
        )


async def main(rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="agentkv-templating-"))
    config = EngineConfig(model=default_model_path(), slots=2, ctx_per_slot=32768, port=0)
    async with LlamaServerProcess(
        config, binary=find_llama_server(), log_dir=root, startup_timeout=300
    ) as process:
        kept = process.client(read_timeout=120)
        fresh: LlamaSlotClient = process.client(read_timeout=120)
        # A new connection for every call, as before.
        fresh._transport._kept = fresh._transport._http
        for name, body in bodies().items():
            await measure(name, body, kept, fresh, rounds)
        print("Claude Code's session, its third turn after its second:")
        await next_turn(kept, rounds)
        await kept.aclose()
        await fresh.aclose()


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 3)
