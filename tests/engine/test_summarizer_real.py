"""agentkv's own summaries written by a second llama-server (``--compaction-model``), on the real
default model (here the small model and the agents' model are the same file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv_bench.metrics import parse_counters
from tests._engine_fixture import locate_engine
from tests.fakes import wait_for
from tests.server.test_long_context_real import READ_TOOL, history

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

AGENT = "long-talker"


async def test_the_small_engine_writes_the_summary_and_the_agents_engine_only_prefills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the high-water mark the summary is generated on the second llama-server; the agents'
    engine generates only the agent's reply and the one token of the compacted conversation's
    prefill, and the agent's next request is rewritten with that summary."""
    _, model = locate_engine()
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    settings = EngineSettings(
        model=model, compaction_model=model, slots=1, ctx_per_slot=4096, store=False, gpu_layers=0
    )
    config = RuntimeConfig(compact_at=700, compact_keep_messages=4)
    body: dict[str, Any] = {
        "model": "agentkv-local",
        "max_tokens": 8,
        "temperature": 0,
        "system": "You are a coding agent. Answer briefly.",
        "tools": [READ_TOOL],
        "messages": [*history(4), {"role": "user", "content": "Which module is the longest?"}],
    }
    async with assemble(settings, config) as built, built.runtime as runtime:
        summarizer, client = runtime.summarizer, built.client
        assert isinstance(summarizer, LlamaSlotClient) and isinstance(client, LlamaSlotClient)
        main_before = parse_counters(await client.metrics())
        small_before = parse_counters(await summarizer.metrics())
        reply = await runtime.submit(await runtime.prepare(body, agent=AGENT, priority=1)).message()
        assert runtime.compactor.store.pending(AGENT)
        compactor = runtime.compactor
        await wait_for(lambda: not compactor.store.pending(AGENT), timeout=300)
        assert compactor.store.latest(AGENT) is not None
        main = parse_counters(await client.metrics())
        small = parse_counters(await summarizer.metrics())
        written = small["predicted"] - small_before["predicted"]
        generated_here = main["predicted"] - main_before["predicted"]
        assert written >= 10, (small_before, small)  # the summary
        # the reply (at most 8 tokens) and the prefill's one token
        assert generated_here <= reply["usage"]["output_tokens"] + 2, (main_before, main)
        follow = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"}]}
        follow["messages"].append({"role": "user", "content": "And the shortest?"})
        prepared = await runtime.prepare(follow, agent=AGENT, priority=1)
        assert "conversation-summary" in str(prepared.engine.body["messages"])
