"""Prepared compaction on the real engine: a request one byte off is not served, and a client
that arrives while the prepared reply is being generated gets what is generated at once.

The requests have Claude Code's shape (its system prompt's first words, an earlier exchange, the
compaction instruction it ships), kept small: the slot is sized so that a reply of a few hundred
tokens of context is past Claude Code's compaction point (``window − max_tokens − 13000``). The
real CLI's own compaction, served from what was prepared, is
tests/claude/test_prepared_compaction.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentkv.forecast import CompactionForecast, compaction_point, context_tokens
from agentkv.reply import Delta
from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Exchange, Runtime
from tests._engine_fixture import locate_engine
from tests.fakes import wait_for
from tests.runtime.test_prepared import joined_batches

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

MAX_TOKENS = 192
#: The slot asked for: the compaction point is then 208 tokens of context (llama-server rounds a
#: slot up, to 13,568 here: 376), below the first turn's prompt (about 700 tokens), and the
#: compaction request (the instruction is about 1,500 tokens more) fits.
CTX = MAX_TOKENS + 13000 + 208


def turn() -> dict[str, Any]:
    return {
        "model": "agentkv-local",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "system": "You are Claude Code, a coding assistant. " + "Answer in one word. " * 100,
        "messages": [
            {"role": "user", "content": "Reply with the single word: alpha"},
            {"role": "assistant", "content": [{"type": "text", "text": "alpha"}]},
            {"role": "user", "content": "Reply with the single word: beta"},
        ],
    }


async def send(runtime: Runtime, body: dict[str, Any], agent: str) -> Exchange:
    return runtime.submit(await runtime.prepare(body, agent=agent, priority=1))


async def prepared_for(runtime: Runtime, agent: str) -> tuple[Exchange, dict[str, Any]]:
    """The agent's turn, and the compaction it made known: running in the background, and the
    request Claude Code would send for it."""
    body = turn()
    reply = await (await send(runtime, body, agent)).message()
    assert reply["stop_reason"] == "end_turn", reply
    window = runtime.preparations.window
    assert window is not None and window >= CTX
    assert context_tokens(reply["usage"]) > compaction_point(window, MAX_TOKENS), reply["usage"]
    compaction = CompactionForecast().predict(body, reply, window)
    assert compaction is not None
    await wait_for(lambda: any(e.prepared.agent == agent for e in runtime.preparations.running()))
    (background,) = (e for e in runtime.preparations.running() if e.prepared.agent == agent)
    return background, compaction


async def test_one_byte_off_is_not_served_and_a_client_mid_generation_joins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model = locate_engine()
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    settings = EngineSettings(model=model, slots=2, ctx_per_slot=CTX, store=False, gpu_layers=0)
    async with assemble(settings, RuntimeConfig()) as built, built.runtime as runtime:
        # One byte off: the agent's own request is computed for it; the preparation is stopped.
        background, compaction = await prepared_for(runtime, "one-byte")
        await wait_for(lambda: background.record.generated > 2 or background.done, timeout=120)
        changed = dict(compaction, messages=[*compaction["messages"][:-1]])
        changed["messages"].append(
            {"role": "user", "content": compaction["messages"][-1]["content"] + "."}
        )
        exchange = await send(runtime, changed, "one-byte")
        assert exchange is not background
        message = await exchange.message()
        assert message["usage"]["output_tokens"] > 0  # generated for this request
        await wait_for(lambda: background.done, timeout=120)
        stats = runtime.preparations.stats()
        assert stats.missed["differs"] == 1 and stats.served + stats.joined == 0, stats

        # Exactly the request, while it is being generated: what is generated comes at once.
        background, compaction = await prepared_for(runtime, "joins")
        await wait_for(lambda: background.record.generated >= 4 or background.done, timeout=120)
        assert not background.done, "the prepared reply ended before the client came"
        before = "".join(e.value for e in background.emitted if isinstance(e, Delta))
        exchange = await send(runtime, compaction, "joins")
        assert exchange is background
        batches = await joined_batches(exchange)  # the first at once, then the rest
        assert before and batches[0].startswith(before)
        whole = await exchange.message()
        assert "".join(batches) == "".join(
            b.get("text", "") for b in whole["content"] if b.get("type") == "text"
        )
        stats = runtime.preparations.stats()
        assert (stats.joined, stats.served) == (1, 0), stats
